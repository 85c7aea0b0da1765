"""The peers comparison (``peers.json``, ``mxdb.peers``): its figures, from the runs' samples.

A peers bundle times, per point (model family, token count M, routing), in one interleaved
process on one GPU:

- (a) FlagGems' own config (role ``baseline``), (b) vLLM's shipped table (role ``peer``),
  (c) the config mxdb dispatches for the point's routing class (role ``candidate``),
  (d) mxdb's routing-oblivious choice (role ``candidate``; only where it differs from (c)),
  and a same-config control pair of (c) (``ctl1``, ``ctl2``);
- eager time: FlagGems' ``fused_experts_impl`` (in run (a)'s ``eager_timing``) against mxdb's
  lean ``MoELayer`` with config (c) (in run (c)'s ``eager_timing``).

``peers.json`` names each point's runs by id (their raw samples are in ``runs/``) and claims
the figures below; :func:`build_peers` computes them, and the auditor recomputes them with the
same function from the runs it holds.  Definitions (medians are ``stats.median`` of the raw
samples):

- ``noise_band`` = ``stats.pair_noise`` of the control pair; ``floor_us`` = active experts x
  3 x H x I x bytes per element / bandwidth; ``floor_fraction_x`` = floor / median(x);
- ``speedup_c_over_x`` = median(x) / median(c) (``d`` falls back to ``c`` where they agree);
- ``c_slower_than_x``: median(c) > median(x) x (1 + noise band);
- ``winner``: the label of the smallest GPU-time median among a, b, c, d;
- ``eager_speedup_layer_over_fused_experts_impl`` = eager median(a) / eager median(c);
  ``eager_over_graph_layer`` = eager median(c) / graph median(c);
- geometric means over points with the figure (``decode_*``: over points with M at most
  ``decode_max_tokens``), counts of points with a flag set;
- each target: its figure (``measured``), a fixed threshold and comparison, and ``passed``.

Documents of schema 1.1 may say ``rule: "verdict"``: then the control pair ``ctl1``, ``ctl2``
holds copies of (a), every arm was timed in rounds of randomized order (sample ``r`` of each
run is round ``r``), and "slower" / "faster" are the one verdict rule's outcomes
(:func:`mxdb.verdict.compare`, margin 0): (c) against (a)'s three copies; (c) against (b), and
(d) against (c), with the noise band of (a)'s copies; ``noise_band`` is that band.  Their
``routing_source`` says where the points' routing came from (held-out instances of a
generator the tuner never used).

Documents of schema 1.4 are the 1.3 layout with the decode floor measured against a second
bandwidth: ``read_bandwidth_bytes_per_s``, a streaming read (a float32 sum over 2 GiB of bf16)
timed in the same run, next to the copy bandwidth every ``floor_us`` uses.  A layer at decode
batch sizes mostly reads weights, and a copy also writes what it reads, so the copy floor alone
can flatter it.  ``figures`` adds ``decode_geomean_floor_fraction_c_read``, the decode geomean
floor fraction of (c) with the floor from the read bandwidth: since a floor is bytes /
bandwidth, it is ``decode_geomean_floor_fraction_c`` x copy / read bandwidth.  A pooled
document with a read bandwidth is 1.4; one without it is still written as 1.3.

Documents of schema 1.3 are the 1.2 layout below, judged on the targets of a comparison on
held-out routing (:data:`HELDOUT_TARGETS`: 1.03x over FlagGems' choice, 1.01x over vLLM's
table, no point slower than either); 1.2 documents keep :data:`TARGETS`.  In 1.3, where (c)
ran (a)'s or (b)'s own config on an instance, it is compared with that arm as itself (one
kernel: :func:`pooled_point_figures`); its median stays the one measured.

Documents of schema 1.2 (``rule: "verdict"``, points with ``instances``) judge each point, a
routing *distribution* (family, M, routing kind), on several held-out instances of it (K
traces drawn with different seeds), each timed in its own interleaved rounds of random order.
A point then has no ``runs`` or ``trace_hash`` of its own (both ``null``); each entry of its
``instances`` has ``instance`` (the index), ``trace_hash``, ``runs`` (label -> run id, as
above), ``dispatch_reason_c`` / ``dispatch_reason_d`` (what the dispatcher answered for that
instance), and figures recomputed from its trace and runs alone:

- ``routing_class`` = ``mxdb.routing.classify`` of the instance's trace (instances of one
  point may differ), ``active_experts``, ``hot_share``, ``floor_us`` of that trace;
- ``median_us`` per label; ``noise_band``, ``speedup_c_over_a`` / ``outcome_c_vs_a`` and
  ``speedup_c_over_b`` / ``outcome_c_vs_b``: :func:`mxdb.verdict.compare` on that instance's
  rounds alone (as in schema 1.1); ``c_differs_from_d``: the instance has a run (d).

The point's figures **pool** its instances: for each label, the samples of all instances
concatenated in instance order (``d`` takes (c)'s samples in an instance without a (d) run,
where they are one config), so that round ``r`` of the pooled arms is still one round of one
instance and the paired statistic stays valid.  Then, with ``verdict.compare`` exactly as in
schema 1.1 on the pooled rounds: ``noise_band`` is the band of (a)'s pooled copies;
``c_slower_than_a`` / ``c_faster_than_a`` are (c) against (a)'s three pooled copies;
``c_slower_than_b`` / ``c_faster_than_b`` are (c) against pooled (b) with that band;
``d_faster_than_c`` is (d) against (c) with that band (only where some instance has (d)).
``speedup_c_over_a`` / ``speedup_c_over_b`` are those comparisons' pooled paired speedups
(the median over all pooled rounds of the per-round ratio, :func:`mxdb.verdict.paired`), and
``speedup_c_over_d`` = ``verdict.paired(d, c)``'s speedup (1 where no instance has (d)); so the
geometric means of the targets are geomeans of pooled paired speedups.  ``median_us`` and
``eager_median_us`` are medians of the pooled samples, and every figure defined on medians
above (``winner``, floor fractions, ``speedup_best_over_x``, ``floor_bound_over_a``) uses
them.  ``active_experts``, ``hot_share`` and ``floor_us`` are the means over the instances
(each instance weighs the same, as each has the same number of rounds); ``routing_class``,
``dispatch_reason_c`` and ``dispatch_reason_d`` list the instances' distinct values in
instance order joined by ``","`` (None where none was recorded); ``c_config_is_a`` /
``c_config_is_b`` hold when every instance's (c) ran that config; ``c_differs_from_d`` when
some instance has (d).  ``figures`` adds ``n_instances`` and ``instances_c_slower_than_a`` /
``instances_c_slower_than_b`` (instances, over all points, whose own verdict is "slower"), and
``explanations`` lists those instances (``instances_c_slower_than_a`` / ``_b``, with the
instance's speedup and class and whether the pooled point is slower), so what pooling
absorbs stays visible.  The targets are the same figures as before.

Documents with ``explanations`` (written since the layout that explains missed targets; the
auditor recognises the layout by that field) also carry, per point:

- ``hot_share``: the largest share of the token slots (M x k) that one expert receives, from
  the point's trace; ``floor_fraction_best`` = floor / the smallest median of a, b, c, d;
  ``speedup_best_over_x`` = median(x) / that smallest median; ``floor_bound_over_a`` =
  median(a) / floor (the speedup over (a) of a layer at the floor: no config can give more);
- ``c_config_is_a`` / ``c_config_is_b``: (c) ran the same config (hash) as (a) / (b);
  ``c_faster_than_x``: median(x) > median(c) x (1 + noise band); ``d_faster_than_c`` likewise;
- ``uniform_floor_fraction_best``: ``floor_fraction_best`` of the uniform-routing point of the
  same family and M, and ``skew_cost`` = that over this point's (what the skew costs the
  fastest config, the floor accounting for the active experts); None for uniform routing;
- ``dispatch_reason_c`` / ``dispatch_reason_d``: what the dispatcher answered (an input the
  run recorded, like the routing; a fallback reason requires (c) to run (a)'s config);

and ``explanations``: for each target the figures that bound or explain it (geometric means
and counts over the points above, the points behind each count), all recomputed by the
auditor from the same rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, cast

from pydantic import BaseModel, Field

from mxdb import verdict
from mxdb.evidence import stats
from mxdb.evidence.cells import cell
from mxdb.evidence.models import _Doc, optional_fields
from mxdb.shapes import memory_floor_bytes

REPORT_FILE = "report/peers.md"
PEERS_FILE = "peers.json"
SCHEMA = "mxdb.peers"
SCHEMA_VERSION = "1.5"
#: The versions judged on held-out routing (and comparing a config with itself as one
#: kernel): 1.3; 1.4, which adds the streaming-read floor; 1.5, judged against the incumbent.
HELDOUT_VERSIONS: tuple[str, ...] = ("1.3", "1.4", "1.5")
#: The versions that carry ``read_bandwidth_bytes_per_s`` (where it was measured).
READ_BANDWIDTH_VERSIONS: tuple[str, ...] = ("1.4", "1.5")
#: The versions judged against the incumbent (:data:`INCUMBENT_TARGETS`): (b) is the
#: incumbent's config (``mxdb.incumbent``), the held-out seeds are salted (``seed_salt``) and
#: the document says whether its comparison guided a change (``data_use``).
INCUMBENT_VERSIONS: tuple[str, ...] = ("1.5",)
#: What a comparison's data was used for: ``test`` (drawn once, for this check) or
#: ``development`` (its results guided a change: not a test of that change).
DATA_USES: tuple[str, ...] = ("test", "development")
#: The version of documents judged by the verdict rule on one routing instance per point.
SINGLE_INSTANCE_VERSION = "1.1"
DECODE_MAX_TOKENS = 16
#: A skewed point is "far from the floor" when the fastest config's floor fraction under uniform
#: routing (same family and M) is more than this many times its floor fraction there.
SKEW_COST = 1.10
#: Dispatch reasons under which the dispatcher answered with a stored entry; any other reason
#: is a fallback, and (c) is then FlagGems' own config.
ENTRY_REASONS: tuple[str, ...] = (
    "exact_match",
    "adjacent_routing",
    "neighbour_tokens",
    "neighbour_tokens_adjacent_routing",
    "parity",
    "peer_parity",  # the same, as earlier versions recorded it
)
#: The labels of a point's runs; ``d`` is absent where mxdb's choice ignores the routing.
LABELS: tuple[str, ...] = ("a", "b", "c", "d", "ctl1", "ctl2")
#: The role each label's run must carry.
ROLES: dict[str, str] = {
    "a": "baseline",
    "b": "peer",
    "c": "candidate",
    "d": "candidate",
    "ctl1": "control",
    "ctl2": "control",
}

Comparison = Literal["ge", "le"]


class TargetSpec(BaseModel):
    """A target a claim is judged against: ``figure`` compared with ``threshold``."""

    model_config = {"frozen": True}

    name: str
    figure: str
    comparison: Comparison
    threshold: float
    statement: str


#: The peers comparison's targets (fixed here: the auditor checks a document's thresholds).
TARGETS: tuple[TargetSpec, ...] = (
    TargetSpec(
        name="c_vs_flaggems_geomean",
        figure="geomean_speedup_c_over_a",
        comparison="ge",
        threshold=1.10,
        statement="GPU time: geomean speedup of mxdb's dispatch (c) over FlagGems' own config "
        "(a) of at least 1.10x over all points",
    ),
    TargetSpec(
        name="c_vs_vllm_geomean",
        figure="geomean_speedup_c_over_b",
        comparison="ge",
        threshold=1.02,
        statement="GPU time: geomean speedup of mxdb's dispatch (c) over vLLM's H200 table (b) "
        "of at least 1.02x over all points",
    ),
    TargetSpec(
        name="c_never_slower_than_flaggems",
        figure="points_c_slower_than_a",
        comparison="le",
        threshold=0.0,
        statement="no point where (c) is slower than (a) beyond the control pair's noise",
    ),
    TargetSpec(
        name="c_never_slower_than_vllm",
        figure="points_c_slower_than_b",
        comparison="le",
        threshold=0.0,
        statement="no point where (c) is slower than (b) beyond the control pair's noise",
    ),
    TargetSpec(
        name="routing_aware_pays",
        figure="geomean_c_over_d_where_changed",
        comparison="ge",
        threshold=1.0,
        statement="where the routing changes mxdb's choice, the routing-aware config (c) is "
        "at least as fast as the routing-oblivious one (d), geomean (mxdb's own check: the "
        "issue asks for this figure, not a threshold)",
    ),
    TargetSpec(
        name="decode_eager_layer_vs_fused_experts_impl",
        figure="decode_geomean_eager_speedup",
        comparison="ge",
        threshold=2.0,
        statement="eager: at decode (M <= 16) mxdb's MoELayer call is at least 2x faster than "
        "FlagGems' fused_experts_impl, geomean",
    ),
    TargetSpec(
        name="decode_eager_layer_near_graph",
        figure="decode_geomean_eager_over_graph",
        comparison="le",
        threshold=1.3,
        statement="eager: at decode (M <= 16) mxdb's MoELayer call is within 1.3x of its own "
        "graph-replay time, geomean",
    ),
    TargetSpec(
        name="decode_floor_fraction",
        figure="decode_geomean_floor_fraction_c",
        comparison="ge",
        threshold=0.90,
        statement="decode points (M <= 16): mxdb's dispatch (c) reaches at least 90% of the "
        "memory-bound floor, geomean",
    ),
)


#: The targets of a comparison on held-out routing (documents of schema 1.3): the held-out
#: peers figures of verification, with the other checks of :data:`TARGETS`.
HELDOUT_TARGETS: tuple[TargetSpec, ...] = (
    TargetSpec(
        name="c_vs_flaggems_geomean",
        figure="geomean_speedup_c_over_a",
        comparison="ge",
        threshold=1.03,
        statement="GPU time on held-out routing: geomean speedup of mxdb's dispatch (c) over "
        "FlagGems' own config (a) of at least 1.03x over all points",
    ),
    TargetSpec(
        name="c_vs_vllm_geomean",
        figure="geomean_speedup_c_over_b",
        comparison="ge",
        threshold=1.01,
        statement="GPU time on held-out routing: geomean speedup of mxdb's dispatch (c) over "
        "vLLM's H200 table (b) of at least 1.01x over all points",
    ),
    *(t for t in TARGETS if t.name not in ("c_vs_flaggems_geomean", "c_vs_vllm_geomean")),
)


#: The targets of a comparison against the incumbent (schema 1.5): (b) is what the user runs
#: today (vLLM's table row for the device, else FlagGems' default); FlagGems' default (a)
#: stays a column of the figures.
INCUMBENT_TARGETS: tuple[TargetSpec, ...] = (
    TargetSpec(
        name="c_vs_incumbent_geomean",
        figure="geomean_speedup_c_over_b",
        comparison="ge",
        threshold=1.06,
        statement="GPU time on fresh held-out routing: geomean speedup of mxdb's dispatch (c) "
        "over the incumbent (b: vLLM's table row for the device) of at least 1.06x over all "
        "points",
    ),
    TargetSpec(
        name="c_never_slower_than_incumbent",
        figure="points_c_slower_than_b",
        comparison="le",
        threshold=0.0,
        statement="no point where (c) is slower than the incumbent (b) by the verdict rule",
    ),
    TargetSpec(
        name="routing_aware_never_slower",
        figure="points_d_faster_than_c",
        comparison="le",
        threshold=0.0,
        statement="no point where mxdb's routing-oblivious answer (d) is faster than its "
        "routing-aware one (c) beyond the noise band",
    ),
    *(t for t in TARGETS if t.name.startswith("decode_")),
)


#: The targets of a zero-shot comparison (schema 1.5, ``zero_shot``): families the store never
#: measured, answered by the performance model where it is confident, else by the incumbent.
ZERO_SHOT_TARGETS: tuple[TargetSpec, ...] = (
    TargetSpec(
        name="zero_shot_vs_incumbent_geomean",
        figure="geomean_speedup_c_over_b",
        comparison="ge",
        threshold=1.03,
        statement="zero-shot, fresh held-out routing: geomean speedup of mxdb's dispatch (c: "
        "the performance model, else the incumbent) over the incumbent (b) of at least 1.03x",
    ),
    TargetSpec(
        name="zero_shot_never_slower_than_incumbent",
        figure="points_c_slower_than_b_3pct",
        comparison="le",
        threshold=0.0,
        statement="zero-shot: no point where (c) is slower than the incumbent (b) by the "
        "verdict rule and by more than 3%",
    ),
)


def targets_for(schema_version: str, zero_shot: bool = False) -> tuple[TargetSpec, ...]:
    """The targets a document of ``schema_version`` is judged on (1.3, 1.4: held-out routing;
    1.5: against the incumbent, ``zero_shot``: for families the store never measured)."""
    if schema_version in INCUMBENT_VERSIONS:
        return ZERO_SHOT_TARGETS if zero_shot else INCUMBENT_TARGETS
    return HELDOUT_TARGETS if schema_version in HELDOUT_VERSIONS else TARGETS


def judge(comparison: str, measured: float | None, threshold: float) -> bool:
    """Whether ``measured`` meets the target (a missing figure never does)."""
    if measured is None:
        return False
    return measured >= threshold if comparison == "ge" else measured <= threshold


def build_targets(
    figures: Mapping[str, Any], specs: Sequence[TargetSpec | Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Each target with its measured figure and verdict."""
    out = []
    for s in specs:
        spec = s if isinstance(s, TargetSpec) else TargetSpec(**s)
        measured = figures.get(spec.figure)
        value = None if measured is None else float(measured)
        out.append(
            {
                "name": spec.name,
                "statement": spec.statement,
                "figure": spec.figure,
                "comparison": spec.comparison,
                "threshold": spec.threshold,
                "measured": value,
                "passed": judge(spec.comparison, value, spec.threshold),
            }
        )
    return out


def targets_markdown(targets: Sequence[Mapping[str, Any]]) -> list[str]:
    """Markdown table lines of targets: the statement, threshold, measured figure, verdict."""
    lines = ["| target | threshold | measured | result |", "|---|---|---|---|"]
    for t in targets:
        op = ">=" if t["comparison"] == "ge" else "<="
        measured = "-" if t["measured"] is None else f"{t['measured']:.3f}"
        lines.append(
            f"| {t['name']}: {t['statement']} | {t['figure']} {op} {t['threshold']:g} | "
            f"{measured} | {'pass' if t['passed'] else 'MISS'} |"
        )
    return lines


class Target(_Doc):
    """One target: the figure it judges, threshold, the measured value and the verdict."""

    name: str = Field(min_length=1)
    statement: str
    figure: str = Field(description="the name of the figure (in ``figures``) it judges")
    comparison: Comparison = Field(description="ge: measured >= threshold; le: <=")
    threshold: float
    measured: float | None
    passed: bool


class PeerRuns(_Doc):
    """The run ids of one point (raw samples in ``runs/<id>.json``)."""

    a: str
    b: str
    c: str
    d: str | None = Field(description="absent where the routing-oblivious choice is (c)")
    ctl1: str
    ctl2: str


class PeerInstance(_Doc):
    """One held-out routing instance of a point (schema 1.2): its runs and its own verdicts."""

    instance: int = Field(ge=0, description="the instance's index (its seed's index)")
    trace_hash: str
    routing_class: str = Field(description="mxdb.routing.classify of the instance's trace")
    runs: PeerRuns
    dispatch_reason_c: str | None = Field(description="the dispatcher's reason for (c)")
    dispatch_reason_d: str | None = Field(description="the dispatcher's reason for (d)")
    active_experts: int
    hot_share: float
    floor_us: float
    median_us: dict[str, float]
    noise_band: float = Field(description="the band of (a)'s copies in this instance's rounds")
    speedup_c_over_a: float | None = Field(description="verdict.compare's paired speedup")
    outcome_c_vs_a: verdict.Outcome
    speedup_c_over_b: float | None = Field(description="verdict.compare's paired speedup")
    outcome_c_vs_b: verdict.Outcome
    c_differs_from_d: bool


#: Aggregate figures of schema 1.2 (absent from older documents).
INSTANCE_FIGURES: tuple[str, ...] = (
    "n_instances",
    "instances_c_slower_than_a",
    "instances_c_slower_than_b",
)
#: Aggregate figures of schema 1.4 (absent from older documents, and from documents without a
#: read bandwidth).
READ_BANDWIDTH_FIGURES: tuple[str, ...] = ("decode_geomean_floor_fraction_c_read",)
#: The figures of documents judged against the incumbent (schema 1.5).
INCUMBENT_FIGURES: tuple[str, ...] = ("points_d_faster_than_c", "points_c_slower_than_b_3pct")
#: How much slower than the incumbent a zero-shot point may be before it counts.
ZERO_SHOT_SLACK = 0.03
#: Explanations of schema 1.2 (absent from older documents).
INSTANCE_EXPLANATIONS: tuple[str, ...] = ("instances_c_slower_than_a", "instances_c_slower_than_b")

#: Per-point fields of the layout with ``explanations`` (absent from older documents).
EXTENDED_POINT_FIELDS: tuple[str, ...] = (
    "dispatch_reason_c",
    "dispatch_reason_d",
    "hot_share",
    "floor_fraction_best",
    "speedup_best_over_a",
    "speedup_best_over_b",
    "floor_bound_over_a",
    "c_config_is_a",
    "c_config_is_b",
    "c_faster_than_a",
    "c_faster_than_b",
    "d_faster_than_c",
    "uniform_floor_fraction_best",
    "skew_cost",
)


class PeerPoint(_Doc):
    """One point: its runs and the figures derived from their samples."""

    model_config = optional_fields(*EXTENDED_POINT_FIELDS, "instances")

    family: str
    tokens: int = Field(ge=1)
    routing: str
    routing_class: str
    trace_hash: str | None = Field(description="null where the point has instances (1.2)")
    runs: PeerRuns | None = Field(description="null where the point has instances (1.2)")
    active_experts: int | float = Field(description="a mean over the instances in 1.2")
    median_us: dict[str, float]
    noise_band: float
    floor_us: float
    winner: str
    speedup_c_over_a: float
    speedup_c_over_b: float
    speedup_c_over_d: float
    c_differs_from_d: bool
    floor_fraction_a: float
    floor_fraction_b: float
    floor_fraction_c: float
    c_slower_than_a: bool
    c_slower_than_b: bool
    eager_median_us: dict[str, float]
    eager_speedup_layer_over_fused_experts_impl: float | None
    eager_over_graph_layer: float | None
    dispatch_reason_c: str | None = Field(
        default=None, description="the dispatcher's reason for (c), as the run recorded it"
    )
    dispatch_reason_d: str | None = Field(
        default=None, description="the dispatcher's reason for (d), as the run recorded it"
    )
    hot_share: float | None = Field(
        default=None, description="largest share of the M x k token slots one expert receives"
    )
    floor_fraction_best: float | None = Field(
        default=None, description="floor / the smallest median of a, b, c, d"
    )
    speedup_best_over_a: float | None = None
    speedup_best_over_b: float | None = None
    floor_bound_over_a: float | None = Field(
        default=None, description="median(a) / floor: the most any config could gain over (a)"
    )
    c_config_is_a: bool | None = None
    c_config_is_b: bool | None = None
    c_faster_than_a: bool | None = None
    c_faster_than_b: bool | None = None
    d_faster_than_c: bool | None = None
    uniform_floor_fraction_best: float | None = Field(
        default=None,
        description="floor_fraction_best of the uniform-routing point of the same family and M "
        "(None for uniform routing)",
    )
    skew_cost: float | None = Field(
        default=None,
        description="uniform_floor_fraction_best / floor_fraction_best (None for uniform routing)",
    )
    instances: list[PeerInstance] | None = Field(
        default=None,
        description="the held-out instances whose pooled rounds the point's figures judge "
        "(schema 1.2; absent before)",
    )


class PointRef(_Doc):
    """A point named in an explanation, with the figures that explain it."""

    family: str
    tokens: int
    routing: str
    figures: dict[str, float | str | bool | None]


class GapExplanation(_Doc):
    """What bounds a geometric-mean speedup of (c) over one peer (a or b)."""

    geomean_speedup_best_over_peer: float | None = Field(
        description="geomean of median(peer) / smallest median of a, b, c, d: the figure "
        "had mxdb dispatched the fastest config measured at every point"
    )
    decode_geomean_speedup_c_over_peer: float | None
    rest_geomean_speedup_c_over_peer: float | None = Field(description="over points with M > 16")
    points_c_is_peer: int = Field(description="points where (c) ran the peer's own config")
    points_c_faster: int = Field(description="points where (c) is faster beyond the noise")
    points_c_within_noise: int = Field(description="neither faster nor slower beyond the noise")
    points_c_slower: int
    points_slower_with_peer_config: int = Field(
        description="points where (c) ran the peer's own config and still timed slower beyond "
        "the control pair's noise band (the band understates the noise there)"
    )
    slower_by_dispatch_reason: dict[str, int] = Field(
        description="points where (c) is slower beyond the noise, by the dispatcher's reason"
    )


class Explanations(_Doc):
    """Figures that explain each missed target, recomputed like every other figure."""

    model_config = optional_fields(*INSTANCE_EXPLANATIONS)

    c_over_a: GapExplanation
    c_over_b: GapExplanation
    decode_geomean_floor_bound_over_a: float | None = Field(
        description="geomean over decode points of median(a) / floor: the speedup over (a) "
        "of a layer running at the memory-bound floor"
    )
    decode_geomean_floor_fraction_a: float | None
    decode_geomean_floor_fraction_b: float | None
    decode_geomean_floor_fraction_best: float | None = Field(
        description="the decode floor fraction of the fastest config measured at each point"
    )
    c_slower_than_a: list[PointRef]
    c_slower_than_b: list[PointRef]
    d_faster_than_c: list[PointRef]
    skew_cost_threshold: float
    skewed_far_from_floor: list[PointRef] = Field(
        description="non-uniform points whose skew_cost exceeds skew_cost_threshold: the "
        "fastest config reaches that many times less of the floor than under uniform routing"
    )
    instances_c_slower_than_a: list[PointRef] | None = Field(
        default=None,
        description="schema 1.2: each instance whose own verdict has (c) slower than (a), "
        "with its index, class, speedup and whether its pooled point is slower",
    )
    instances_c_slower_than_b: list[PointRef] | None = Field(
        default=None, description="schema 1.2: likewise against (b)"
    )


class PeerFigures(_Doc):
    """The comparison's aggregate figures."""

    model_config = optional_fields(*INSTANCE_FIGURES, *READ_BANDWIDTH_FIGURES, *INCUMBENT_FIGURES)

    n_points: int
    geomean_speedup_c_over_a: float | None
    geomean_speedup_c_over_b: float | None
    points_c_slower_than_a: int
    points_c_slower_than_b: int
    decode_geomean_floor_fraction_c: float | None
    decode_geomean_floor_fraction_c_read: float | None = Field(
        default=None,
        description="schema 1.4: decode_geomean_floor_fraction_c with the floor from the "
        "streaming-read bandwidth (x bandwidth_bytes_per_s / read_bandwidth_bytes_per_s)",
    )
    decode_geomean_eager_speedup: float | None
    decode_geomean_eager_over_graph: float | None
    points_routing_changes_dispatch: int
    points_d_faster_than_c: int | None = Field(
        default=None,
        description="schema 1.5: points where (d) is faster than (c) beyond the noise band",
    )
    points_c_slower_than_b_3pct: int | None = Field(
        default=None,
        description="schema 1.5: points where (c) is slower than (b) and by more than 3%",
    )
    geomean_c_over_d_where_changed: float | None = Field(
        description="geomean of median(d) / median(c) over points where (d) differs"
    )
    n_instances: int | None = Field(default=None, description="schema 1.2: instances timed")
    instances_c_slower_than_a: int | None = Field(
        default=None, description="schema 1.2: instances whose own verdict has (c) slower than (a)"
    )
    instances_c_slower_than_b: int | None = Field(
        default=None, description="schema 1.2: instances whose own verdict has (c) slower than (b)"
    )


class PeersDoc(_Doc):
    """``peers.json``: FlagGems, vLLM's table and mxdb's dispatch side by side."""

    model_config = optional_fields(
        "explanations",
        "rule",
        "routing_source",
        "read_bandwidth_bytes_per_s",
        "seed_salt",
        "data_use",
        "zero_shot",
    )

    schema_name: Literal["mxdb.peers"] = Field(default="mxdb.peers", alias="schema")
    schema_version: Literal["1.0", "1.1", "1.2", "1.3", "1.4", "1.5"] = "1.5"
    milestone: str
    fingerprint_hash: str
    bandwidth_bytes_per_s: float = Field(
        description="device-to-device copy bandwidth measured in the same run (input)"
    )
    read_bandwidth_bytes_per_s: float | None = Field(
        default=None,
        description="streaming-read bandwidth (bytes read per second, a float32 sum over 2 GiB "
        "of bf16) measured in the same run (input; schema 1.4)",
    )
    decode_max_tokens: int
    points: list[PeerPoint]
    figures: PeerFigures
    targets: list[Target]
    dispatch_cost: dict[str, dict[str, float]] = Field(
        description="host time per call (us) of mxdb's dispatch hit and FlagGems' config "
        "lookup, per family (host measurements, reported as measured)"
    )
    errors: list[str]
    explanations: Explanations | None = Field(
        default=None, description="what bounds or explains each target's figure"
    )
    rule: Literal["verdict"] | None = Field(
        default=None,
        description="verdict: slower/faster by mxdb.verdict on paired rounds, ctl1/ctl2 copies "
        "of (a) (schema 1.1; pooled over a point's instances in 1.2); absent: the control "
        "pair's median band",
    )
    routing_source: str | None = Field(
        default=None, description="where the points' routing instances came from"
    )
    seed_salt: str | None = Field(
        default=None,
        description="schema 1.5: the salt of this run's held-out seeds (drawn for it, once)",
    )
    zero_shot: bool | None = Field(
        default=None,
        description="schema 1.5: families the store never measured, (c) answered by the "
        "performance model or the incumbent (judged on the zero-shot targets)",
    )
    data_use: Literal["test", "development"] | None = Field(
        default=None,
        description="schema 1.5: test (its seeds were drawn once, for this check) or "
        "development (its results guided a change: not a test of that change)",
    )


def _samples(run: Mapping[str, Any] | None, key: str = "timing") -> list[float] | None:
    t = (run or {}).get(key) or {}
    s = t.get("samples_us")
    return [float(x) for x in s] if s else None


def trace_figures(ids: Iterable[Iterable[int]]) -> tuple[int, float]:
    """(active experts, hot share) of a top-k trace: distinct experts, and the largest share
    of the token slots one expert receives."""
    counts: dict[int, int] = {}
    slots = 0
    for row in ids:
        for x in row:
            counts[int(x)] = counts.get(int(x), 0) + 1
            slots += 1
    return len(counts), (max(counts.values()) / slots if slots else 0.0)


def point_figures(
    labels: Mapping[str, str | None],
    runs: Mapping[str, Mapping[str, Any]],
    *,
    active_experts: int,
    bandwidth_bytes_per_s: float,
    hot_share: float | None = None,
    dispatch: Mapping[str, str | None] | None = None,
    rule: str | None = None,
) -> dict[str, Any]:
    """The figures of one point from its runs' raw samples (``KeyError`` on a missing run).

    With ``hot_share`` (the layout with explanations) the point's extended figures too.
    """
    med: dict[str, float] = {}
    for lab in LABELS:
        rid = labels.get(lab)
        if rid is None:
            continue
        s = _samples(runs[rid])
        if s is None:
            raise KeyError(rid)
        med[lab] = stats.median(s)
    emed: dict[str, float] = {}
    for lab in ("a", "c"):
        s = _samples(runs[str(labels[lab])], "eager_timing")
        if s is not None:
            emed[lab] = stats.median(s)
    shape = runs[str(labels["c"])]["shape"]
    floor_bytes = memory_floor_bytes(
        active_experts, shape["hidden"], shape["intermediate"], shape["dtype"]
    )
    floor = floor_bytes / bandwidth_bytes_per_s * 1e6
    noise = stats.pair_noise(med["ctl1"], med["ctl2"])
    a, b, c = med["a"], med["b"], med["c"]
    d = med.get("d", c)
    tol = 1.0 + noise
    judged: dict[str, bool] = {}
    if rule == "verdict":
        raw = {lab: _samples(runs[str(rid)]) or [] for lab, rid in labels.items() if rid}
        copies = [raw["a"], raw["ctl1"], raw["ctl2"]]
        band = verdict.noise_band(copies)
        noise = band if band is not None else math.inf
        over_a = verdict.compare(copies, raw["c"])
        over_b = verdict.compare([raw["b"]], raw["c"], band=noise)
        d_over_c = verdict.compare([raw["c"]], raw.get("d") or raw["c"], band=noise)
        judged = {
            "c_slower_than_a": over_a.slower,
            "c_slower_than_b": over_b.slower,
            "c_faster_than_a": over_a.faster,
            "c_faster_than_b": over_b.faster,
            "d_faster_than_c": "d" in raw and d_over_c.faster,
        }
    out: dict[str, Any] = {
        "active_experts": active_experts,
        "median_us": med,
        "noise_band": noise,
        "floor_us": floor,
        "winner": min((m, n) for n, m in med.items() if n in ("a", "b", "c", "d"))[1],
        "speedup_c_over_a": stats.speedup(a, c),
        "speedup_c_over_b": stats.speedup(b, c),
        "speedup_c_over_d": stats.speedup(d, c),
        "c_differs_from_d": "d" in med,
        "floor_fraction_a": floor / a,
        "floor_fraction_b": floor / b,
        "floor_fraction_c": floor / c,
        "c_slower_than_a": judged.get("c_slower_than_a", c > a * tol),
        "c_slower_than_b": judged.get("c_slower_than_b", c > b * tol),
        "eager_median_us": emed,
        "eager_speedup_layer_over_fused_experts_impl": emed["a"] / emed["c"]
        if len(emed) == 2
        else None,
        "eager_over_graph_layer": emed["c"] / c if "c" in emed else None,
    }
    if hot_share is None:
        return out
    best = min(a, b, c, d)

    def config_hash(lab: str) -> Any:
        return runs[str(labels[lab])].get("config_hash")

    out.update(
        {
            "dispatch_reason_c": (dispatch or {}).get("c"),
            "dispatch_reason_d": (dispatch or {}).get("d"),
            "hot_share": hot_share,
            "floor_fraction_best": floor / best,
            "speedup_best_over_a": stats.speedup(a, best),
            "speedup_best_over_b": stats.speedup(b, best),
            "floor_bound_over_a": a / floor,
            "c_config_is_a": config_hash("c") == config_hash("a"),
            "c_config_is_b": config_hash("c") == config_hash("b"),
            "c_faster_than_a": judged.get("c_faster_than_a", a > c * tol),
            "c_faster_than_b": judged.get("c_faster_than_b", b > c * tol),
            "d_faster_than_c": judged.get("d_faster_than_c", c > d * tol),
            "uniform_floor_fraction_best": None,
            "skew_cost": None,
        }
    )
    return out


def trace_class(ids: Iterable[Iterable[int]], experts: int) -> str:
    """The routing class of a trace: ``mxdb.routing.classify`` of its features."""
    import numpy as np

    from mxdb.routing import classify, features

    arr = np.asarray([list(r) for r in ids], dtype=np.int64)
    return str(classify(features(arr, experts)))


def _joined(values: Iterable[str | None]) -> str | None:
    """The distinct recorded values in order of first appearance, joined by ``","``."""
    seen: list[str] = []
    for v in values:
        if v is not None and v not in seen:
            seen.append(v)
    return ",".join(seen) if seen else None


def _paired_speedup(v: verdict.Verdict, baseline: float, candidate: float) -> float:
    """A verdict's paired speedup, or the medians' ratio where it has none (unpaired arms)."""
    return v.speedup if v.speedup is not None else stats.speedup(baseline, candidate)


def pooled_point_figures(
    instances: Sequence[Mapping[str, Any]],
    runs: Mapping[str, Mapping[str, Any]],
    *,
    active_experts: Mapping[str, int],
    hot_shares: Mapping[str, float],
    trace_classes: Mapping[str, str],
    bandwidth_bytes_per_s: float,
    same_config_same_kernel: bool = False,
) -> dict[str, Any]:
    """The figures of a point of schema 1.2 from its instances' runs (see the module doc).

    With ``same_config_same_kernel`` (schema 1.3), an instance on which (c) ran (a)'s or (b)'s
    config is compared with that arm as itself: one kernel, so a difference between two timings
    of it is the timing's (its rounds enter the comparison as (a)'s round baselines, or (b)'s
    samples: a paired ratio of exactly 1).  ``KeyError`` on a missing run or trace.
    """
    pooled: dict[str, list[float]] = {lab: [] for lab in LABELS}
    c_vs: dict[str, list[float]] = {"a": [], "b": []}
    eager: dict[str, list[float]] = {"a": [], "c": []}
    rows: list[dict[str, Any]] = []
    has_d, c_is_a, c_is_b = False, True, True
    for inst in instances:
        labels = {lab: inst["runs"].get(lab) for lab in LABELS}
        raw: dict[str, list[float]] = {}
        for lab, rid in labels.items():
            if rid is None:
                continue
            s = _samples(runs[rid])
            if s is None:
                raise KeyError(rid)
            raw[lab] = s
        for lab in ("a", "b", "c", "ctl1", "ctl2"):
            pooled[lab] += raw[lab]
        pooled["d"] += raw.get("d", raw["c"])
        has_d |= "d" in raw
        for lab in ("a", "c"):
            eager[lab] += _samples(runs[str(labels[lab])], "eager_timing") or []

        def config_hash(lab: str, labels: Mapping[str, str | None] = labels) -> Any:
            return runs[str(labels[lab])].get("config_hash")

        same_a = config_hash("c") == config_hash("a")
        same_b = config_hash("c") == config_hash("b")
        c_is_a &= same_a
        c_is_b &= same_b
        th = inst["trace_hash"]
        shape = runs[str(labels["c"])]["shape"]
        floor_bytes = memory_floor_bytes(
            active_experts[th], shape["hidden"], shape["intermediate"], shape["dtype"]
        )
        copies = [raw["a"], raw["ctl1"], raw["ctl2"]]
        band = verdict.noise_band(copies)
        noise = band if band is not None else math.inf
        c_for_a, c_for_b = raw["c"], raw["c"]
        if same_config_same_kernel and same_a:
            c_for_a = verdict.round_baseline(copies) or raw["c"]
        if same_config_same_kernel and same_b:
            c_for_b = raw["b"]
        c_vs["a"] += c_for_a
        c_vs["b"] += c_for_b
        over_a = verdict.compare(copies, c_for_a)
        over_b = verdict.compare([raw["b"]], c_for_b, band=noise)
        rows.append(
            {
                "instance": inst["instance"],
                "trace_hash": th,
                "routing_class": trace_classes[th],
                "runs": labels,
                "dispatch_reason_c": inst.get("dispatch_reason_c"),
                "dispatch_reason_d": inst.get("dispatch_reason_d"),
                "active_experts": active_experts[th],
                "hot_share": hot_shares[th],
                "floor_us": floor_bytes / bandwidth_bytes_per_s * 1e6,
                "median_us": {lab: stats.median(x) for lab, x in raw.items()},
                "noise_band": noise,
                "speedup_c_over_a": over_a.speedup,
                "outcome_c_vs_a": over_a.outcome,
                "speedup_c_over_b": over_b.speedup,
                "outcome_c_vs_b": over_b.outcome,
                "c_differs_from_d": "d" in raw,
            }
        )
    n = len(rows)
    if n == 0:
        raise KeyError("a point of schema 1.2 without instances")
    med = {lab: stats.median(x) for lab, x in pooled.items() if lab != "d" or has_d}
    emed = {lab: stats.median(x) for lab, x in eager.items() if x}
    copies = [pooled["a"], pooled["ctl1"], pooled["ctl2"]]
    band = verdict.noise_band(copies)
    noise = band if band is not None else math.inf
    over_a = verdict.compare(copies, c_vs["a"])
    over_b = verdict.compare([pooled["b"]], c_vs["b"], band=noise)
    d_over_c = verdict.compare([pooled["c"]], pooled["d"], band=noise)
    c_over_d = verdict.paired(pooled["d"], pooled["c"])
    a, b, c = med["a"], med["b"], med["c"]
    d = med.get("d", c)
    floor = math.fsum(r["floor_us"] for r in rows) / n
    best = min(a, b, c, d)
    return {
        "routing_class": _joined(r["routing_class"] for r in rows),
        "trace_hash": None,
        "runs": None,
        "active_experts": math.fsum(r["active_experts"] for r in rows) / n,
        "median_us": med,
        "noise_band": noise,
        "floor_us": floor,
        "winner": min((m, lab) for lab, m in med.items() if lab in ("a", "b", "c", "d"))[1],
        "speedup_c_over_a": _paired_speedup(over_a, a, c),
        "speedup_c_over_b": _paired_speedup(over_b, b, c),
        "speedup_c_over_d": c_over_d.speedup if c_over_d is not None else stats.speedup(d, c),
        "c_differs_from_d": has_d,
        "floor_fraction_a": floor / a,
        "floor_fraction_b": floor / b,
        "floor_fraction_c": floor / c,
        "c_slower_than_a": over_a.slower,
        "c_slower_than_b": over_b.slower,
        "eager_median_us": emed,
        "eager_speedup_layer_over_fused_experts_impl": emed["a"] / emed["c"]
        if len(emed) == 2
        else None,
        "eager_over_graph_layer": emed["c"] / c if "c" in emed else None,
        "dispatch_reason_c": _joined(r["dispatch_reason_c"] for r in rows),
        "dispatch_reason_d": _joined(r["dispatch_reason_d"] for r in rows),
        "hot_share": math.fsum(r["hot_share"] for r in rows) / n,
        "floor_fraction_best": floor / best,
        "speedup_best_over_a": stats.speedup(a, best),
        "speedup_best_over_b": stats.speedup(b, best),
        "floor_bound_over_a": a / floor,
        "c_config_is_a": c_is_a,
        "c_config_is_b": c_is_b,
        "c_faster_than_a": over_a.faster,
        "c_faster_than_b": over_b.faster,
        "d_faster_than_c": has_d and d_over_c.faster,
        "uniform_floor_fraction_best": None,
        "skew_cost": None,
        "instances": rows,
    }


def skew_costs(rows: Sequence[dict[str, Any]]) -> None:
    """Set ``uniform_floor_fraction_best`` and ``skew_cost`` on non-uniform rows with a twin."""
    uniform = {(r["family"], r["tokens"]): r for r in rows if r["routing"] == "uniform"}
    for r in rows:
        twin = uniform.get((r["family"], r["tokens"]))
        if r["routing"] != "uniform" and twin is not None:
            r["uniform_floor_fraction_best"] = twin["floor_fraction_best"]
            r["skew_cost"] = twin["floor_fraction_best"] / r["floor_fraction_best"]


def aggregate(
    points: Sequence[Mapping[str, Any]],
    decode_max_tokens: int,
    *,
    bandwidth_bytes_per_s: float | None = None,
    read_bandwidth_bytes_per_s: float | None = None,
    incumbent: bool = False,
) -> dict[str, Any]:
    """The aggregate figures over the points (``incumbent``: also schema 1.5's).

    With both bandwidths (the copy bandwidth of the points' floors and a read bandwidth: schema
    1.4) also ``decode_geomean_floor_fraction_c_read``.
    """

    def gm(key: str, pred: Callable[[Mapping[str, Any]], bool] = lambda r: True) -> float | None:
        return stats.geomean(float(r[key]) for r in points if r.get(key) and pred(r))

    def decode(r: Mapping[str, Any]) -> bool:
        return int(r["tokens"]) <= decode_max_tokens

    out: dict[str, Any] = {
        "n_points": len(points),
        "geomean_speedup_c_over_a": gm("speedup_c_over_a"),
        "geomean_speedup_c_over_b": gm("speedup_c_over_b"),
        "points_c_slower_than_a": sum(1 for r in points if r["c_slower_than_a"]),
        "points_c_slower_than_b": sum(1 for r in points if r["c_slower_than_b"]),
        "decode_geomean_floor_fraction_c": gm("floor_fraction_c", decode),
        "decode_geomean_eager_speedup": gm("eager_speedup_layer_over_fused_experts_impl", decode),
        "decode_geomean_eager_over_graph": gm("eager_over_graph_layer", decode),
        "points_routing_changes_dispatch": sum(1 for r in points if r["c_differs_from_d"]),
        "geomean_c_over_d_where_changed": gm("speedup_c_over_d", lambda r: r["c_differs_from_d"]),
    }
    if incumbent:
        out["points_d_faster_than_c"] = sum(1 for r in points if r.get("d_faster_than_c"))
        out["points_c_slower_than_b_3pct"] = sum(
            1
            for r in points
            if r["c_slower_than_b"] and float(r["speedup_c_over_b"]) < 1.0 - ZERO_SHOT_SLACK
        )
    if bandwidth_bytes_per_s is not None and read_bandwidth_bytes_per_s is not None:
        # floor_us = bytes / bandwidth at every point, so the read floor is the copy floor
        # scaled by copy / read, and so is each fraction and their geomean
        c = out["decode_geomean_floor_fraction_c"]
        out["decode_geomean_floor_fraction_c_read"] = (
            None if c is None else c * bandwidth_bytes_per_s / read_bandwidth_bytes_per_s
        )
    if any(r.get("instances") for r in points):
        inst = [i for r in points for i in r.get("instances") or ()]
        out["n_instances"] = len(inst)
        for x in ("a", "b"):
            out[f"instances_c_slower_than_{x}"] = sum(
                1 for i in inst if i[f"outcome_c_vs_{x}"] == "slower"
            )
    return out


def _ref(r: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    return {
        "family": r["family"],
        "tokens": r["tokens"],
        "routing": r["routing"],
        "figures": {k: r[k] for k in keys},
    }


def explain(points: Sequence[Mapping[str, Any]], decode_max_tokens: int) -> dict[str, Any]:
    """The ``explanations`` of the layout that explains missed targets (see the docstring)."""

    def gm(
        vals: Iterable[Mapping[str, Any]], key: str | Callable[[Mapping[str, Any]], float]
    ) -> float | None:
        get = (lambda r: float(r[key])) if isinstance(key, str) else key
        return stats.geomean(get(r) for r in vals)

    decode = [r for r in points if int(r["tokens"]) <= decode_max_tokens]
    rest = [r for r in points if int(r["tokens"]) > decode_max_tokens]

    def gap(x: str) -> dict[str, Any]:
        faster = sum(1 for r in points if r[f"c_faster_than_{x}"])
        slow = [r for r in points if r[f"c_slower_than_{x}"]]
        slower = len(slow)
        reasons: dict[str, int] = {}
        for r in slow:
            key = str(r["dispatch_reason_c"] or "unrecorded")
            reasons[key] = reasons.get(key, 0) + 1
        return {
            "geomean_speedup_best_over_peer": gm(points, f"speedup_best_over_{x}"),
            "decode_geomean_speedup_c_over_peer": gm(decode, f"speedup_c_over_{x}"),
            "rest_geomean_speedup_c_over_peer": gm(rest, f"speedup_c_over_{x}"),
            "points_c_is_peer": sum(1 for r in points if r[f"c_config_is_{x}"]),
            "points_c_faster": faster,
            "points_c_within_noise": len(points) - faster - slower,
            "points_c_slower": slower,
            "points_slower_with_peer_config": sum(1 for r in slow if r[f"c_config_is_{x}"]),
            "slower_by_dispatch_reason": dict(sorted(reasons.items())),
        }

    slower_keys = ("speedup_c_over_a", "speedup_c_over_b", "noise_band", "dispatch_reason_c")
    skew_keys = ("hot_share", "floor_fraction_best", "uniform_floor_fraction_best", "skew_cost")
    out: dict[str, Any] = {
        "c_over_a": gap("a"),
        "c_over_b": gap("b"),
        "decode_geomean_floor_bound_over_a": gm(decode, "floor_bound_over_a"),
        "decode_geomean_floor_fraction_a": gm(decode, "floor_fraction_a"),
        "decode_geomean_floor_fraction_b": gm(decode, "floor_fraction_b"),
        "decode_geomean_floor_fraction_best": gm(decode, "floor_fraction_best"),
        "c_slower_than_a": [_ref(r, slower_keys) for r in points if r["c_slower_than_a"]],
        "c_slower_than_b": [_ref(r, slower_keys) for r in points if r["c_slower_than_b"]],
        "d_faster_than_c": [
            _ref(r, ("speedup_c_over_d", "noise_band", "routing_class", "dispatch_reason_c"))
            for r in points
            if r["d_faster_than_c"]
        ],
        "skew_cost_threshold": SKEW_COST,
        "skewed_far_from_floor": [
            _ref(r, skew_keys)
            for r in points
            if r["skew_cost"] is not None and r["skew_cost"] > SKEW_COST
        ],
    }
    if any(r.get("instances") for r in points):
        for x in ("a", "b"):
            out[f"instances_c_slower_than_{x}"] = [
                {
                    "family": r["family"],
                    "tokens": r["tokens"],
                    "routing": r["routing"],
                    "figures": {
                        "instance": i["instance"],
                        "routing_class": i["routing_class"],
                        f"speedup_c_over_{x}": i[f"speedup_c_over_{x}"],
                        "noise_band": i["noise_band"],
                        "dispatch_reason_c": i["dispatch_reason_c"],
                        f"pooled_c_slower_than_{x}": r[f"c_slower_than_{x}"],
                    },
                }
                for r in points
                for i in r.get("instances") or ()
                if i[f"outcome_c_vs_{x}"] == "slower"
            ]
    return out


def build_peers(
    points: Sequence[Mapping[str, Any]],
    runs: Mapping[str, Mapping[str, Any]],
    active_experts: Mapping[str, int],
    *,
    milestone: str,
    fingerprint_hash: str,
    bandwidth_bytes_per_s: float,
    decode_max_tokens: int = DECODE_MAX_TOKENS,
    targets: Sequence[TargetSpec | Mapping[str, Any]] | None = None,
    dispatch_cost: Mapping[str, Mapping[str, float]] | None = None,
    errors: Sequence[str] = (),
    hot_shares: Mapping[str, float] | None = None,
    rule: str | None = None,
    routing_source: str | None = None,
    trace_classes: Mapping[str, str] | None = None,
    schema_version: str | None = None,
    read_bandwidth_bytes_per_s: float | None = None,
    seed_salt: str | None = None,
    data_use: str | None = None,
    zero_shot: bool = False,
) -> dict[str, Any]:
    """The ``peers.json`` document: ``points`` give identity and run ids, the rest is computed.

    Each point needs ``family``, ``tokens``, ``routing``, ``routing_class``, ``trace_hash`` and
    ``runs`` (label -> run id); ``active_experts`` maps a trace hash to its distinct experts.
    With ``hot_shares`` (trace hash -> hot share, :func:`trace_figures`) the document has the
    layout with ``explanations``; each point then may carry ``dispatch_reason_c`` and
    ``dispatch_reason_d`` (the dispatcher's recorded answers).

    A point of schema 1.2 instead has ``instances``: each with ``instance``, ``trace_hash``,
    ``runs`` and optionally ``dispatch_reason_c`` / ``dispatch_reason_d``; it needs
    ``rule="verdict"``, ``hot_shares`` and ``trace_classes`` (trace hash -> :func:`trace_class`),
    and its figures pool the instances (:func:`pooled_point_figures`).  Any such point makes the
    document schema 1.3 (the 1.2 layout; ``targets`` default to :func:`targets_for` it), or 1.4
    with ``read_bandwidth_bytes_per_s`` (the 1.3 layout with the streaming-read floor);
    ``schema_version`` ("1.2", "1.3" or "1.4") rebuilds an earlier pooled document as it was
    written.  Only 1.4 and 1.5 documents carry the read bandwidth: the other layouts have no
    place for it, and leave it out.  ``seed_salt`` (with the read bandwidth and instances) makes
    the document 1.5: judged against the incumbent, with ``data_use`` ("test" or "development").
    """
    pooled = any(p.get("instances") for p in points)
    if pooled and (rule != "verdict" or hot_shares is None or trace_classes is None):
        raise ValueError("points with instances need rule 'verdict', hot shares and trace classes")
    version = SINGLE_INSTANCE_VERSION if rule else "1.0"
    if pooled:
        version = "1.3" if read_bandwidth_bytes_per_s is None else "1.4"
        if seed_salt is not None and read_bandwidth_bytes_per_s is not None:
            version = SCHEMA_VERSION
        if schema_version in ("1.2", *HELDOUT_VERSIONS):
            version = schema_version
    if version in INCUMBENT_VERSIONS and (seed_salt is None or data_use not in DATA_USES):
        raise ValueError(f"a {version} document needs a seed salt and a data use in {DATA_USES}")
    read = read_bandwidth_bytes_per_s if version in READ_BANDWIDTH_VERSIONS else None
    rows = []
    for p in points:
        if p.get("instances"):
            fig = pooled_point_figures(
                p["instances"],
                runs,
                active_experts=active_experts,
                hot_shares=cast(Mapping[str, float], hot_shares),
                trace_classes=cast(Mapping[str, str], trace_classes),
                bandwidth_bytes_per_s=bandwidth_bytes_per_s,
                same_config_same_kernel=version in HELDOUT_VERSIONS,
            )
            rows.append({k: p[k] for k in ("family", "tokens", "routing")} | fig)
            continue
        labels = {lab: p["runs"].get(lab) for lab in LABELS}
        fig = point_figures(
            labels,
            runs,
            active_experts=active_experts[p["trace_hash"]],
            bandwidth_bytes_per_s=bandwidth_bytes_per_s,
            hot_share=None if hot_shares is None else hot_shares[p["trace_hash"]],
            dispatch={"c": p.get("dispatch_reason_c"), "d": p.get("dispatch_reason_d")},
            rule=rule,
        )
        ident = {k: p[k] for k in ("family", "tokens", "routing", "routing_class", "trace_hash")}
        rows.append({**ident, "runs": labels, **fig})
    if hot_shares is not None:
        skew_costs(rows)
    figures = aggregate(
        rows,
        decode_max_tokens,
        bandwidth_bytes_per_s=bandwidth_bytes_per_s,
        read_bandwidth_bytes_per_s=read,
        incumbent=version in INCUMBENT_VERSIONS,
    )
    if targets is None:
        targets = targets_for(version, zero_shot)
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "schema_version": version,
        "milestone": milestone,
        "fingerprint_hash": fingerprint_hash,
        "bandwidth_bytes_per_s": bandwidth_bytes_per_s,
        **({} if read is None else {"read_bandwidth_bytes_per_s": read}),
        "decode_max_tokens": decode_max_tokens,
        "points": rows,
        "figures": figures,
        "targets": build_targets(figures, targets),
        "dispatch_cost": {k: dict(v) for k, v in (dispatch_cost or {}).items()},
        "errors": list(errors),
    }
    if hot_shares is not None:
        doc["explanations"] = explain(rows, decode_max_tokens)
    if rule is not None:
        doc["rule"] = rule
        doc["routing_source"] = routing_source
    if version in INCUMBENT_VERSIONS:
        doc["seed_salt"] = seed_salt
        doc["data_use"] = data_use
        if zero_shot:
            doc["zero_shot"] = True
    return doc


def to_json(doc: Mapping[str, Any]) -> dict[str, Any]:
    """``doc`` validated as :class:`PeersDoc`, as written: the optional fields of a later
    layout (``rule``, ``routing_source``, ``instances``, the 1.2 figures and explanations, the
    1.4 read bandwidth) are left out where they are null, so a document of an earlier layout
    keeps its fields."""
    out = PeersDoc.model_validate(doc).to_json_dict()
    for key in (
        "rule",
        "routing_source",
        "seed_salt",
        "data_use",
        "zero_shot",
    ):  # later layouts' fields
        if out.get(key) is None:
            out.pop(key, None)
    for p in out["points"]:
        if p.get("instances") is None:
            p.pop("instances", None)
    for key in (*INSTANCE_FIGURES, *INCUMBENT_FIGURES):
        if out["figures"].get(key) is None:
            out["figures"].pop(key, None)
    if out.get("read_bandwidth_bytes_per_s") is None:
        # the read floor's figure goes with its input (it may be null in 1.4: no decode point)
        out.pop("read_bandwidth_bytes_per_s", None)
        for key in READ_BANDWIDTH_FIGURES:
            out["figures"].pop(key, None)
    ex = out.get("explanations")
    if ex is not None:
        for key in INSTANCE_EXPLANATIONS:
            if ex.get(key) is None:
                ex.pop(key, None)
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _even_share(family: str) -> float | None:
    from mxdb.errors import ShapeError
    from mxdb.shapes import family_shape

    try:
        return 1.0 / int(family_shape(family, 1).experts)
    except ShapeError:
        return None


def _point_name(ref: Mapping[str, Any]) -> str:
    return f"{ref['family']} M={ref['tokens']} {ref['routing']}"


def _gap_text(t: Mapping[str, Any]) -> str:
    m, thr = t["measured"], t["threshold"]
    if m is None:
        return "no figure was measured"
    if t["comparison"] == "ge":
        return f"measured {m:.3f} against >= {thr:g}: short by {thr - m:.3f} ({m / thr:.1%} of it)"
    return f"measured {m:g} against <= {thr:g}: over by {m - thr:g}"


def _listing(refs: Sequence[Mapping[str, Any]], fmt: Callable[[Mapping[str, Any]], str]) -> str:
    if not refs:
        return ""
    shown = [f"{_point_name(r)} ({fmt(r['figures'])})" for r in refs[:16]]
    more = f"; and {len(refs) - 16} more (peers.json lists them all)" if len(refs) > 16 else ""
    return "; ".join(shown) + more


def explanations_markdown(doc: Mapping[str, Any]) -> list[str]:
    """Markdown lines: for each missed target, its figure, the gap and the measured reasons.

    Every number comes from ``peers.json`` (``figures``, ``targets``, ``explanations``), which
    the auditor recomputes from the runs' samples and the traces.
    """
    ex = doc.get("explanations")
    if not ex:
        return []
    n = doc["figures"]["n_points"]
    dmax = doc["decode_max_tokens"]
    lines = ["## Why targets are missed (from the measurements)", ""]
    missed = [t for t in doc["targets"] if not t["passed"]]
    if not missed:
        lines += ["Every target is met.", ""]
    for t in missed:
        name = t["name"]
        lines.append(f"- **{name}**: {_gap_text(t)}.")
        if name in ("c_vs_flaggems_geomean", "c_vs_vllm_geomean"):
            flaggems = "flaggems" in name
            x = "a" if flaggems else "b"
            peer = "(a), FlagGems' choice," if flaggems else "(b), vLLM's table,"
            g = ex[f"c_over_{x}"]
            best = g["geomean_speedup_best_over_peer"]
            reach = (
                "below the threshold too: no choice among the configs measured reaches it"
                if best is not None and best < t["threshold"]
                else "so better choices among the measured configs would close part of the gap"
            )
            lines.append(
                f"  Had mxdb dispatched the fastest config measured at every point, the geomean "
                f"speedup over {peer} would be {_num(best)}, {reach}. "
                f"(c) ran ({x})'s own config at {g['points_c_is_peer']} of {n} points; it was "
                f"faster than ({x}) beyond the noise band at {g['points_c_faster']}, within it "
                f"at {g['points_c_within_noise']} and slower at {g['points_c_slower']}. Geomean "
                f"(c) over ({x}): {_num(g['decode_geomean_speedup_c_over_peer'])} at decode "
                f"(M <= {dmax}), {_num(g['rest_geomean_speedup_c_over_peer'])} above."
            )
            if x == "a":
                lines.append(
                    f"  At decode points FlagGems' config already reaches "
                    f"{_pct(ex['decode_geomean_floor_fraction_a'])} of the memory-bound floor "
                    f"(geomean), so a layer at the floor would be only "
                    f"{_num(ex['decode_geomean_floor_bound_over_a'])}x faster than (a) there: "
                    "that bounds what any config can gain at decode."
                )
        elif name in ("c_never_slower_than_flaggems", "c_never_slower_than_vllm"):
            x = "a" if "flaggems" in name else "b"
            refs = ex[f"c_slower_than_{x}"]

            def slower(f: Mapping[str, Any], x: str = x) -> str:
                return (
                    f"(c)/({x}) {f[f'speedup_c_over_{x}']:.3f}, noise {f['noise_band']:.2%}, "
                    f"{f['dispatch_reason_c'] or 'no reason recorded'}"
                )

            g = ex[f"c_over_{x}"]
            reasons = ", ".join(f"{k}: {v}" for k, v in g["slower_by_dispatch_reason"].items())
            lines.append(
                f"  The dispatcher's answers at the points where (c) is slower than ({x}): "
                f"{reasons or 'none recorded'}. A neighbour answer is an entry tuned at another "
                "M or routing class; a fallback answer (any reason but exact_match, "
                "adjacent_routing and neighbour_*) runs FlagGems' config; an exact_match slower "
                f"than ({x}) is an entry whose tuned speedup did not hold in this run. At "
                f"{g['points_slower_with_peer_config']} of these points (c) ran ({x})'s own "
                "config: identical configs timed apart by more than the control pair's noise "
                "band, which understates the noise there. Points: " + _listing(refs, slower) + "."
            )
            inst = ex.get(f"instances_c_slower_than_{x}")
            if inst is not None:

                def instance(f: Mapping[str, Any], x: str = x) -> str:
                    return (
                        f"instance {f['instance']}, class {f['routing_class']}, (c)/({x}) "
                        f"{_num(f[f'speedup_c_over_{x}'])}, pooled point slower: "
                        f"{f[f'pooled_c_slower_than_{x}']}"
                    )

                lines.append(
                    f"  Instances where (c) is slower than ({x}) on their own rounds (the point "
                    f"pools its instances): {len(inst)}"
                    + (": " if inst else ".")
                    + _listing(inst, instance)
                )
        elif name == "decode_floor_fraction":
            best = ex["decode_geomean_floor_fraction_best"]
            lines.append(
                f"  At decode points the fastest config measured at each point reaches "
                f"{_pct(best)} of the floor (geomean), FlagGems' config "
                f"{_pct(ex['decode_geomean_floor_fraction_a'])} and vLLM's "
                f"{_pct(ex['decode_geomean_floor_fraction_b'])}"
                + (
                    ": no config measured reaches the target, so the gap is the kernel's, "
                    "not the config choice's."
                    if best is not None and best < t["threshold"]
                    else ": a better choice among the measured configs would close part of it."
                )
            )
        elif name == "routing_aware_pays":
            refs = ex["d_faster_than_c"]
            lines.append(
                f"  (d) is faster than (c) beyond the noise band at {len(refs)} points"
                + (": " if refs else ".")
                + _listing(
                    refs,
                    lambda f: (
                        f"(c)/(d) {f['speedup_c_over_d']:.3f}, noise {f['noise_band']:.2%}, "
                        f"class {f['routing_class']}"
                    ),
                )
            )
        else:
            lines.append("  No further measured breakdown is recorded for this target.")
    skewed = ex["skewed_far_from_floor"]
    lines += [
        "",
        f"### Skewed points far from the floor ({len(skewed)})",
        "",
        "Non-uniform points where the fastest config measured reaches more than "
        f"{ex['skew_cost_threshold']:g}x less of the memory-bound floor than under uniform "
        "routing at the same family and M (the floor counts the experts that receive tokens): "
        "the hottest expert's tokens serialize on that expert's tiles while the others idle, "
        "whatever the config.",
        "",
    ]
    if skewed:
        lines += [
            "| point | hottest expert's share of slots | even split | best floor fraction | "
            "same, uniform routing | skew cost |",
            "|---|---|---|---|---|---|",
        ]
        for r in skewed:
            f = r["figures"]
            lines.append(
                f"| {_point_name(r)} | {_pct(f['hot_share'])} | "
                f"{_pct(_even_share(r['family']))} | {_num(f['floor_fraction_best'])} | "
                f"{_num(f['uniform_floor_fraction_best'])} | {_num(f['skew_cost'])}x |"
            )
    return [*lines, ""]


def _decode_floor(doc: Mapping[str, Any]) -> str:
    """(c)'s decode floor fraction for the report: of the copy floor, and of the streaming-read
    floor where the document measured it (schema 1.4; earlier reports keep their words)."""
    f = doc["figures"]
    c = cell(f["decode_geomean_floor_fraction_c"])
    read = doc.get("read_bandwidth_bytes_per_s")
    if read is None:
        return f"{c} of the floor"
    return (
        f"{c} of the copy-bandwidth floor ({doc['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s), "
        f"{cell(f.get('decode_geomean_floor_fraction_c_read'))} of the streaming-read floor "
        f"({read / 1e12:.2f} TB/s)"
    )


def render(doc: Mapping[str, Any]) -> str:
    """``report/peers.md``: the figures of ``peers.json`` (a view; the audit checks the JSON)."""
    f = {**doc["figures"], "points": doc["points"]}

    lines = [
        "# FlagGems (a), vLLM table (b), mxdb dispatch (c), routing-oblivious mxdb (d) on the H200",
        "",
        f"- GPU-time geomean speedup (c)/(a): {cell(f['geomean_speedup_c_over_a'])}; "
        f"(c)/(b): {cell(f['geomean_speedup_c_over_b'])}",
        f"- points where (c) is slower than (a) / (b) beyond the control pair's noise: "
        f"{f['points_c_slower_than_a']} / {f['points_c_slower_than_b']} of {f['n_points']}",
        f"- decode (M <= 16): (c) at {_decode_floor(doc)} "
        f"(geomean); eager layer {cell(f['decode_geomean_eager_speedup'])}x faster than "
        f"fused_experts_impl; eager/graph {cell(f['decode_geomean_eager_over_graph'])}",
        f"- points where routing changes mxdb's dispatch: {f['points_routing_changes_dispatch']}; "
        f"geomean (d)/(c) there: {cell(f['geomean_c_over_d_where_changed'])}",
        "",
        "| family | M | routing | a us | b us | c us | c/a | c/b | floor frac c | "
        "floor frac best | hot share | noise | dispatch (c) | eager fg/layer | eager/graph |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in f["points"]:
        m = r["median_us"]
        hs = r.get("hot_share")
        lines.append(
            f"| {r['family']} | {r['tokens']} | {r['routing']} | {cell(m.get('a'))} | "
            f"{cell(m.get('b'))} | {cell(m.get('c'))} | {cell(r.get('speedup_c_over_a'))} | "
            f"{cell(r.get('speedup_c_over_b'))} | {cell(r.get('floor_fraction_c'))} | "
            f"{cell(r.get('floor_fraction_best'))} | {'-' if hs is None else f'{hs:.2f}'} | "
            f"{cell(r.get('noise_band'))} | {r.get('dispatch_reason_c') or '-'} | "
            f"{cell(r.get('eager_speedup_layer_over_fused_experts_impl'))} | "
            f"{cell(r.get('eager_over_graph_layer'))} |"
        )
    if f.get("n_instances") is not None:  # schema 1.2: the instances behind each point
        lines[4:4] = [
            f"- each point pools {f['n_instances']} held-out routing instances in all "
            "(speedups: paired over the pooled rounds); instances where (c) is slower than "
            f"(a) / (b) on their own rounds: {f['instances_c_slower_than_a']} / "
            f"{f['instances_c_slower_than_b']} of {f['n_instances']}",
        ]
        lines += [
            "",
            "## Instances (each judged on its own rounds)",
            "",
            "| family | M | routing | instance | class | dispatch (c) | c/a | vs a | c/b | vs b |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in f["points"]:
            for i in r.get("instances") or ():
                lines.append(
                    f"| {r['family']} | {r['tokens']} | {r['routing']} | {i['instance']} | "
                    f"{i['routing_class']} | {i.get('dispatch_reason_c') or '-'} | "
                    f"{cell(i['speedup_c_over_a'])} | {i['outcome_c_vs_a']} | "
                    f"{cell(i['speedup_c_over_b'])} | {i['outcome_c_vs_b']} |"
                )
    lines += ["", *targets_markdown(doc["targets"]), "", *explanations_markdown(doc)]
    return "\n".join(lines).rstrip("\n") + "\n"
