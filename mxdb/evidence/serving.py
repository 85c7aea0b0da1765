"""The serving path on one GPU (``serving.json``, ``mxdb.serving`` 1.1), from raw samples.

A serving bundle is a directory::

    manifest.json      mxdb.manifest     SHA-256 of every other file (written last)
    fingerprint.json   mxdb.fingerprint  the environment of both runs
    serving.json       mxdb.serving      raw samples, the figures derived, the targets
    report.md                            a rendering of serving.json (:func:`render_report`)

It holds the two parts of ``benchmarks/serving.py``:

- ``hooked``: per point (model family, token count M, routing), the eager per-call time of
  stock FlagGems' ``fused_experts_impl`` (two same-function copies, ``stock`` and ``stock2``)
  and of the same call through ``mxdb.install()`` (``hooked``): ``rounds`` samples each, one
  per round, the three arms in an order drawn per round (``random.Random(order_seed)``
  shuffling ``[stock, stock2, hooked]``; the benchmark seeds it with M).  Sample ``r`` of every
  arm belongs to round ``r``: the layout :func:`mxdb.verdict.compare` needs, with ``stock`` and
  ``stock2`` as the baseline's same-config copies.  Also the capture check: one hooked call
  captured in a CUDA graph with the routing monitor and healing on, replayed.
- ``healing``: a decode loop through the hook: tokens/s per chunk of steps (CUDA events at
  chunk boundaries) clean, with one config slowed down on some layers without healing
  (``static``) and with healing, and the monitoring-overhead ladder (monitor and healing
  samples off / every N calls).  Version 1.0: the decoder is a stack of MoE layers, and a
  ladder window is half a phase (``steps // 2`` steps).  Version 1.1 adds to the setup the
  ``decoder`` (``stack``, or ``qwen3-moe``: a ``transformers`` Qwen3-MoE model patched by
  ``mxdb.integrations.transformers.patch``, its MoE blocks calling the hook), ``model_check``
  (the patched model's logits against the unpatched model's), ``ladder_steps`` (the steps of a
  ladder window, which replace ``steps // 2`` in the ladder's figures), ``ladder_orders``
  (the rungs' order in each repetition, shuffled per repetition) and ``ladder_persistent``
  (one hook per rung kept for the whole ladder, so that its sampling count goes on across its
  windows: a rung sampling every 4096 calls samples over the ladder as in serving, not never
  within short windows; :data:`DEFINITIONS_1_1`), and to the part the ``ladder_counters``
  (the routing-monitor copies and healing samples each hook had counted at the end of each of
  its windows).

Every figure is recomputed by the audit with :func:`build_serving` (the writer's own function)
from the inputs the document keeps; :data:`DEFINITIONS` says what each one is.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import Field, ValidationError

from mxdb import verdict
from mxdb.errors import EvidenceError
from mxdb.evidence import stats
from mxdb.evidence.cells import cell
from mxdb.evidence.models import _HEX16, _Doc
from mxdb.evidence.peers import Target, TargetSpec, build_targets, targets_markdown
from mxdb.models import Fingerprint

SERVING_SCHEMA = "mxdb.serving"
SERVING_VERSION = "1.1"
SERVING_FILE = "serving.json"
REPORT_FILE = "report.md"
SMALL_TOKENS_MAX = 16
ARMS: tuple[str, ...] = ("stock", "stock2", "hooked")
LADDER: tuple[str, ...] = ("off", "4096", "64", "4")
PHASE_SERIES: tuple[str, ...] = (
    "clean",
    "static_clean",
    "static_injected",
    "healing_clean",
    "healing_injected",
)

SERIES: dict[str, str] = {
    "stock": "FlagGems 5.0.2 fused_experts_impl as shipped: N back-to-back eager calls between "
    "two CUDA events, divided by N (us per call)",
    "stock2": "the same function again: the baseline's same-config copy (noise)",
    "hooked": "the same call through mxdb.install() (lean layer, dispatched config or "
    "FlagGems' choice), timed the same way",
}

DEFINITIONS: dict[str, str] = {
    "speedup": "mxdb.verdict.compare([stock, stock2], hooked).speedup: exp(median over rounds "
    "of log(base_r / hooked_r)), base_r the median of the two stock copies in round r; "
    "speedup_low/high: its 95% sign-test interval; noise_band: |paired speedup of stock2 "
    "over stock - 1|",
    "outcome": "the verdict: faster / slower when the interval clears 1 and the speedup clears "
    "the noise band, else same (not distinguishable)",
    "median_ratio": "median(stock) / median(hooked): what the benchmark's own summary printed",
    "control_pair_band": "max/min - 1 of the medians of stock and stock2 (the earlier rule's band)",
    "slower_by_median_rule": "median_ratio < 1 - control_pair_band (the benchmark summary's "
    "'slower beyond the noise'; not the verdict rule, kept to account for its count)",
    "rounds_hooked_slower": "rounds in which hooked_r > base_r",
    "round_order": "the arms in the order they ran in each round, reconstructed from order_seed",
    "stock_median_us_after_hooked": "median of the stock and stock2 samples timed right after "
    "the hooked arm in their round; stock_median_us_otherwise: of the others",
    "small_geomean_speedup": "geomean of the points' speedups at M <= small_tokens_max",
    "points_slower": "points whose verdict outcome is slower",
    "capture_ok": "1 when the captured hooked call's replay equalled the eager result, the "
    "monitor and healing were deferred during capture (capture_deferred >= 1) and both "
    "resumed after it (a monitor copy and a healing sample after capture); else 0",
    "clean_tokens_per_s": "median tokens/s over the chunks of the clean phase (no injection, "
    "healing off); likewise static_* and healing_clean_* over their phases",
    "healed_tokens_per_s": "median tokens/s over the last tail_chunks chunks of the injected "
    "phase with healing on",
    "healed_over_clean": "healed_tokens_per_s / clean_tokens_per_s",
    "mean_us": "per arm: the mean of its samples (every sample counts)",
    "mean_tokens_per_s": "per phase and ladder rung: the mean of its chunk rates",
    "slow_chunks": "chunks of the injected healing phase below half of clean_tokens_per_s",
    "ladder_overhead": "per rung: 1 - median(rung tokens/s) / median(off tokens/s)",
    "ladder_paired_overhead": "per rung: 1 - median over repetitions of rung_r / off_r (the "
    "rungs ran in a fixed order within a repetition)",
    "ladder_off_spread": "max/min - 1 of the off rung's repetitions (its run-to-run noise)",
    "ladder_healing_samples_in_window": "per rung: the healing samples one timed window can "
    "hold, floor((warm_steps + steps/2) * layers / N) - floor(warm_steps * layers / N) (a fresh "
    "hook per rung, its per-key call count starting at 0; all calls under one key)",
    "ladder_monitor_copies_in_window": "per rung: the routing-monitor copies one timed window "
    "can hold, layers * (floor((warm_steps + steps/2) / N) - floor(warm_steps / N))",
    "ladder_overhead_4096_extrapolated_from_64": "ladder_overhead['64'] * 64 / 4096: the cost "
    "of sampling every 4096 calls if it is proportional to the samples taken (an estimate)",
}

#: What version 1.1 changes in :data:`DEFINITIONS`: the ladder of a ``ladder_persistent`` run
#: keeps one hook per rung for the whole ladder (installed again for each of its windows, its
#: call counts going on), each window one fresh sequence of ``ladder_steps`` steps.
DEFINITIONS_1_1: dict[str, str] = {
    **DEFINITIONS,
    "ladder_paired_overhead_ci": "per rung: [1 - s, 1 - high, 1 - low] for s, [low, high] = "
    "mxdb.verdict.paired(off's seconds per token, the rung's) over the repetitions (the "
    "median paired ratio and its 95% sign-test interval; an unbounded end, with fewer than 6 "
    "repetitions, is null)",
    "ladder_paired_overhead_4096": "ladder_paired_overhead_ci['4096'][0]: the target's figure",
    "ladder_paired_overhead": "per rung: 1 - median over repetitions of rung_r / off_r (the "
    "rungs' order within a repetition is in ladder_orders)",
    "ladder_healing_samples_in_window": "per rung: the healing samples the timed windows hold; "
    "ladder_persistent: summed over the kept windows r = 1..reps, floor(b_r * layers / N) - "
    "floor(a_r * layers / N) with a_r = r * (warm_steps + ladder_steps) + warm_steps and b_r = "
    "(r + 1) * (warm_steps + ladder_steps) (one hook per rung, its count going on across its "
    "windows, repetition 0 not kept); otherwise per window, as in 1.0 with ladder_steps for "
    "steps/2",
    "ladder_monitor_copies_in_window": "per rung: the routing-monitor copies the timed windows "
    "hold; ladder_persistent: layers * the sum over the kept windows of floor(b_r / N) - "
    "floor(a_r / N); otherwise per window, as in 1.0 with ladder_steps for steps/2",
}


#: The serving targets (issue 14; fixed here: the auditor checks a document's thresholds).
TARGETS: tuple[TargetSpec, ...] = (
    TargetSpec(
        name="hooked_geomean_small",
        figure="hooked.small_geomean_speedup",
        comparison="ge",
        threshold=2.0,
        statement="hooked eager call over stock FlagGems' eager call, geomean of the verdict's "
        "paired speedups over the peers points at M <= 16, at least 2x",
    ),
    TargetSpec(
        name="hooked_none_slower",
        figure="hooked.points_slower",
        comparison="le",
        threshold=0.0,
        statement="no point where the hooked call is slower than stock beyond the noise "
        "(mxdb.verdict.compare, stock and stock2 as the baseline's copies)",
    ),
    TargetSpec(
        name="capture_with_monitor_and_healing",
        figure="hooked.capture_ok",
        comparison="ge",
        threshold=1.0,
        statement="a hooked call captured in a CUDA graph with the monitor and healing on "
        "replays to the eager result, and monitoring and healing resume after capture",
    ),
    TargetSpec(
        name="healed_vs_clean",
        figure="healing.healed_over_clean",
        comparison="ge",
        threshold=0.95,
        statement="with one config slowed 10x on some layers, healed tokens/s at least 95% of "
        "clean tokens/s",
    ),
    TargetSpec(
        name="overhead_every_4096",
        figure="healing.ladder_overhead_4096",
        comparison="le",
        threshold=0.01,
        statement="routing monitor and healing sampling every 4096 calls cost at most 1% of "
        "tokens/s (against both off)",
    ),
)

#: Version 1.1 judges the overhead with the paired statistic over the ladder's repetitions
#: (a drift of the machine during the ladder moves every rung of a repetition alike).
TARGETS_1_1: tuple[TargetSpec, ...] = (
    *TARGETS[:-1],
    TargetSpec(
        name="overhead_every_4096",
        figure="healing.ladder_paired_overhead_4096",
        comparison="le",
        threshold=0.01,
        statement="routing monitor and healing sampling every 4096 calls cost at most 1% of "
        "tokens/s: 1 - the paired speedup (mxdb.verdict.paired) of the per-token time of the "
        "rung over monitoring off, over the ladder's repetitions",
    ),
)


def targets_for(schema_version: str) -> tuple[TargetSpec, ...]:
    """The targets a document of ``schema_version`` is judged by."""
    return TARGETS if schema_version == "1.0" else TARGETS_1_1


# -- the document ---------------------------------------------------------------------------


class HookedSamples(_Doc):
    """One point's raw samples, microseconds per call, sample r from round r."""

    stock: list[float] = Field(min_length=1)
    stock2: list[float] = Field(min_length=1)
    hooked: list[float] = Field(min_length=1)


class HookedDecision(_Doc):
    level: str
    reason: str
    entry_id: int | None
    config: dict[str, Any] | None


class HookedPoint(_Doc):
    """One point: its inputs (as recorded), raw samples and the figures derived from them."""

    family: str
    tokens: int = Field(ge=1)
    routing: str
    routing_params: dict[str, Any]
    seed: int | None
    routing_class: str
    decision: HookedDecision
    path: str = Field(description="lean, lean_fallback, flaggems_dispatched, flaggems_fallback")
    hook_stats: dict[str, int]
    equal_to_stock: bool
    max_abs_diff_vs_stock: float
    calls_per_sample: int = Field(ge=1)
    order_seed: int
    samples: HookedSamples
    median_us: dict[str, float]
    mean_us: dict[str, float]
    speedup: float | None
    speedup_low: float | None
    speedup_high: float | None
    noise_band: float | None
    outcome: Literal["faster", "slower", "same"]
    verdict_reason: str
    rounds_hooked_slower: int
    median_ratio: float
    control_pair_band: float
    slower_by_median_rule: bool
    round_order: list[list[str]]
    stock_median_us_after_hooked: float | None
    stock_median_us_otherwise: float | None


class Capture(_Doc):
    ok: bool
    tokens: int
    capture_deferred: int
    monitor_copies_after: int
    healing_samples_after: int
    lean: int
    dispatched: int


class HookedSetup(_Doc):
    store_export: str = Field(description="the store export imported, as recorded")
    store_import: dict[str, int] = Field(description="entries read and added")
    dispatch_fingerprint: str
    dispatch_fingerprint_is_live: bool
    rounds: int = Field(ge=1)
    trace_source: str
    small_tokens_max: int
    series: dict[str, str]
    wall_s: float | None


class HookedFigures(_Doc):
    n_points: int
    n_small_points: int
    small_geomean_speedup: float | None
    small_geomean_median_ratio: float | None
    all_geomean_speedup: float | None
    all_geomean_median_ratio: float | None
    points_faster: int
    points_same: int
    points_slower: int
    points_slower_by_median_rule: int
    slower_points: list[str]
    slower_by_median_rule_points: list[str]
    below_one_points: list[str] = Field(description="points with a paired speedup below 1")
    points_by_path: dict[str, int]
    points_equal_to_stock: int
    capture_ok: float


class HookedPart(_Doc):
    setup: HookedSetup
    points: list[HookedPoint]
    capture: Capture | None
    errors: list[str]
    figures: HookedFigures


class ServingHealingSetup(_Doc):
    model: dict[str, Any]
    tokens: int = Field(ge=1)
    routing_class: str
    factor: int = Field(ge=2)
    slow_layers: list[int]
    target: dict[str, Any]
    alternatives: list[dict[str, Any]]
    steps: int = Field(ge=1, description="decode steps of a phase")
    chunk: int = Field(ge=1, description="steps between two events")
    warm_steps: int = Field(ge=0, description="untimed steps after each ladder install")
    tail_chunks: int = Field(ge=1)
    sample_every: int = Field(ge=1, description="healing samples in the healing phase")
    ladder_reps: int = Field(ge=1)
    ladder_order: list[str]
    store_export: str
    store_import: dict[str, int]
    dispatch_fingerprint: str
    wall_s: float | None
    decoder: str | None = Field(default=None, description="1.1: stack or qwen3-moe")
    model_check: dict[str, float] | None = Field(
        default=None, description="1.1: the patched model's logits against the unpatched model's"
    )
    ladder_steps: int | None = Field(default=None, ge=1, description="1.1: steps of a window")
    ladder_orders: list[list[str]] | None = Field(
        default=None, description="1.1: the rungs' order in each kept repetition"
    )
    ladder_persistent: bool | None = Field(
        default=None, description="1.1: one hook per rung for the whole ladder"
    )


class HealingSamples(_Doc):
    """Tokens/s of each chunk of each phase, in order."""

    clean: list[float] = Field(min_length=1)
    static_clean: list[float] = Field(min_length=1)
    static_injected: list[float] = Field(min_length=1)
    healing_clean: list[float] = Field(min_length=1)
    healing_injected: list[float] = Field(min_length=1)
    ladder: dict[str, list[float]]


class ServingTransition(_Doc):
    sample: int
    kind: str
    from_index: int = Field(alias="from")
    to_index: int = Field(alias="to")
    ratio: float | None
    key: str


class HealingFigures(_Doc):
    clean_tokens_per_s: float
    static_clean_tokens_per_s: float
    static_injected_tokens_per_s: float
    healing_clean_tokens_per_s: float
    healing_injected_tokens_per_s: float
    healed_tokens_per_s: float
    healed_over_clean: float
    healed_over_static: float
    static_over_clean: float
    slow_chunks: int
    mean_tokens_per_s: dict[str, float]
    transitions_by_kind: dict[str, int]
    final_active: int
    ladder_tokens_per_s: dict[str, float]
    ladder_overhead: dict[str, float]
    ladder_overhead_4096: float | None
    ladder_paired_overhead: dict[str, float]
    ladder_off_spread: float
    ladder_healing_samples_in_window: dict[str, int]
    ladder_monitor_copies_in_window: dict[str, int]
    ladder_overhead_4096_extrapolated_from_64: float | None
    ladder_paired_overhead_ci: dict[str, list[float | None]] | None = Field(
        default=None, description="1.1: per rung, [overhead, low, high] (sign-test interval)"
    )
    ladder_paired_overhead_4096: float | None = Field(
        default=None, description="1.1: ladder_paired_overhead_ci['4096'][0]"
    )


class HealingPart(_Doc):
    setup: ServingHealingSetup
    samples: HealingSamples
    slowed_calls: dict[str, int]
    transitions: list[ServingTransition]
    overrides: list[str]
    stats: dict[str, int]
    warm_stats: dict[str, int]
    errors: list[str]
    figures: HealingFigures
    ladder_counters: dict[str, list[dict[str, int]]] | None = Field(
        default=None,
        description="1.1: per rung and kept repetition, the monitor copies and healing samples "
        "the hook counted by the end of the window",
    )


class ServingDoc(_Doc):
    """``serving.json``: the hooked call against stock FlagGems, and self-healing end to end."""

    schema_name: Literal["mxdb.serving"] = Field(default="mxdb.serving", alias="schema")
    schema_version: Literal["1.0", "1.1"] = "1.1"
    milestone: str = Field(min_length=1)
    fingerprint_hash: str = Field(pattern=_HEX16)
    definitions: dict[str, str]
    notes: list[str] = Field(description="analysis and caveats, as written at publication")
    hooked: HookedPart
    healing: HealingPart
    targets: list[Target]


# -- the figures ----------------------------------------------------------------------------


def round_order(seed: int, rounds: int) -> list[list[str]]:
    """The arms in the order ``benchmarks/serving.py``'s ``eager_interleaved`` ran them."""
    rng = random.Random(seed)
    out = []
    for _ in range(rounds):
        order = list(ARMS)
        rng.shuffle(order)
        out.append(order)
    return out


def label(p: Mapping[str, Any]) -> str:
    return f"{p['family']} M={p['tokens']} {p['routing']}"


def point_figures(p: Mapping[str, Any]) -> dict[str, Any]:
    """The figures of one hooked point from its samples (see :data:`DEFINITIONS`)."""
    s = {k: [float(x) for x in p["samples"][k]] for k in ARMS}
    med = {k: stats.median(s[k]) for k in ARMS}
    v = verdict.compare([s["stock"], s["stock2"]], s["hooked"])
    base = verdict.round_baseline([s["stock"], s["stock2"]])
    slower_rounds = (
        sum(1 for b, h in zip(base, s["hooked"], strict=True) if h > b)
        if base is not None and len(base) == len(s["hooked"])
        else 0
    )
    band = stats.pair_noise(med["stock"], med["stock2"])
    ratio = stats.speedup(med["stock"], med["hooked"])
    n = min(len(x) for x in s.values())
    order = round_order(int(p["order_seed"]), n)
    after: list[float] = []
    other: list[float] = []
    for r, arms in enumerate(order):
        for i, arm in enumerate(arms):
            if arm != "hooked":
                (after if i > 0 and arms[i - 1] == "hooked" else other).append(s[arm][r])
    return {
        "median_us": med,
        "mean_us": {k: math.fsum(s[k]) / len(s[k]) for k in ARMS},
        "speedup": v.speedup,
        "speedup_low": v.low,
        "speedup_high": v.high,
        "noise_band": v.noise_band,
        "outcome": v.outcome,
        "verdict_reason": v.reason,
        "rounds_hooked_slower": slower_rounds,
        "median_ratio": ratio,
        "control_pair_band": band,
        "slower_by_median_rule": ratio < 1.0 - band,
        "round_order": order,
        "stock_median_us_after_hooked": stats.median(after) if after else None,
        "stock_median_us_otherwise": stats.median(other) if other else None,
    }


def hook_path(hook_stats: Mapping[str, Any]) -> str:
    """The path the benchmark names for a point from its hook counters."""
    if hook_stats.get("lean"):
        return "lean"
    if hook_stats.get("lean_fallback"):
        return "lean_fallback"
    return "flaggems_dispatched" if hook_stats.get("dispatched") else "flaggems_fallback"


def capture_ok(capture: Mapping[str, Any] | None) -> float:
    if not capture:
        return 0.0
    ok = (
        capture.get("ok") is True
        and int(capture.get("capture_deferred", 0)) >= 1
        and int(capture.get("monitor_copies_after", 0)) >= 1
        and int(capture.get("healing_samples_after", 0)) >= 1
    )
    return 1.0 if ok else 0.0


def hooked_figures(
    points: Sequence[Mapping[str, Any]], capture: Mapping[str, Any] | None, small: int
) -> dict[str, Any]:
    small_pts = [p for p in points if int(p["tokens"]) <= small]

    def gm(rows: Sequence[Mapping[str, Any]], key: str) -> float | None:
        return stats.geomean(float(r[key]) for r in rows if r[key] is not None)

    outcomes = Counter(str(p["outcome"]) for p in points)
    return {
        "n_points": len(points),
        "n_small_points": len(small_pts),
        "small_geomean_speedup": gm(small_pts, "speedup"),
        "small_geomean_median_ratio": gm(small_pts, "median_ratio"),
        "all_geomean_speedup": gm(points, "speedup"),
        "all_geomean_median_ratio": gm(points, "median_ratio"),
        "points_faster": outcomes["faster"],
        "points_same": outcomes["same"],
        "points_slower": outcomes["slower"],
        "points_slower_by_median_rule": sum(1 for p in points if p["slower_by_median_rule"]),
        "slower_points": [label(p) for p in points if p["outcome"] == "slower"],
        "slower_by_median_rule_points": [label(p) for p in points if p["slower_by_median_rule"]],
        "below_one_points": [
            label(p) for p in points if p["speedup"] is not None and p["speedup"] < 1.0
        ],
        "points_by_path": dict(sorted(Counter(str(p["path"]) for p in points).items())),
        "points_equal_to_stock": sum(1 for p in points if p["equal_to_stock"] is True),
        "capture_ok": capture_ok(capture),
    }


def _med(xs: Sequence[float]) -> float:
    return stats.median([float(x) for x in xs])


def _mean(xs: Sequence[float]) -> float:
    return math.fsum(float(x) for x in xs) / len(xs)


def healing_figures(
    setup: Mapping[str, Any],
    samples: Mapping[str, Any],
    transitions: Sequence[Mapping[str, Any]],
    schema_version: str = "1.0",
) -> dict[str, Any]:
    """The figures of the self-healing part from its chunks (see :data:`DEFINITIONS`; 1.1
    adds the paired overhead of :data:`DEFINITIONS_1_1`)."""
    clean = _med(samples["clean"])
    static = _med(samples["static_injected"])
    healed = _med(samples["healing_injected"][-int(setup["tail_chunks"]) :])
    ladder = {k: [float(x) for x in v] for k, v in samples["ladder"].items()}
    lmed = {k: _med(v) for k, v in ladder.items() if v}
    off = ladder.get("off") or []
    overhead: dict[str, float] = {}
    paired: dict[str, float] = {}
    for k, v in ladder.items():
        if k == "off" or not v or not off:
            continue
        overhead[k] = 1.0 - lmed[k] / lmed["off"]
        if len(v) == len(off):
            paired[k] = 1.0 - stats.median([a / b for a, b in zip(v, off, strict=True)])
    layers = int(setup["model"]["layers"])
    warm = int(setup["warm_steps"])
    window = int(setup.get("ladder_steps") or int(setup["steps"]) // 2)
    end = warm + window
    samples_in: dict[str, int] = {}
    copies_in: dict[str, int] = {}
    if setup.get("ladder_persistent"):
        # one hook per rung for the whole ladder: its count goes on over its windows (each
        # after its warm-up steps), and the first repetition (which warms up) is not kept
        per = warm + window
        spans = [(r * per + warm, (r + 1) * per) for r in range(1, int(setup["ladder_reps"]) + 1)]
        for k in ladder:
            every = 0 if k == "off" else int(k)
            samples_in[k] = (
                sum(b * layers // every - a * layers // every for a, b in spans) if every else 0
            )
            copies_in[k] = layers * sum(b // every - a // every for a, b in spans) if every else 0
    else:
        for k in ladder:
            every = 0 if k == "off" else int(k)
            samples_in[k] = (end * layers // every - warm * layers // every) if every else 0
            copies_in[k] = layers * (end // every - warm // every) if every else 0
    active = 0
    for t in transitions:
        if t["kind"] in ("demote", "recover", "exhausted"):
            active = int(t["to"])
    o64 = overhead.get("64")
    extra: dict[str, Any] = {}
    if schema_version != "1.0":
        # tokens/s -> seconds per token, so that the verdict module's paired speedup applies
        pv: dict[str, list[float | None] | None] = {}
        for k, v in ladder.items():
            p = verdict.paired([1.0 / x for x in off], [1.0 / x for x in v]) if k != "off" else None
            if p is None:
                pv[k] = None
                continue
            # with too few repetitions for an interval an end is unbounded: null
            low = 1.0 - p.high if math.isfinite(p.high) else None
            high = 1.0 - p.low if p.low > 0 else None
            pv[k] = [1.0 - p.speedup, low, high]
        extra = {
            "ladder_paired_overhead_ci": {k: v for k, v in pv.items() if v is not None},
            "ladder_paired_overhead_4096": o4096[0] if (o4096 := pv.get("4096")) else None,
        }
    return {
        **extra,
        "clean_tokens_per_s": clean,
        "static_clean_tokens_per_s": _med(samples["static_clean"]),
        "static_injected_tokens_per_s": static,
        "healing_clean_tokens_per_s": _med(samples["healing_clean"]),
        "healing_injected_tokens_per_s": _med(samples["healing_injected"]),
        "healed_tokens_per_s": healed,
        "healed_over_clean": healed / clean,
        "healed_over_static": healed / static,
        "static_over_clean": static / clean,
        "slow_chunks": sum(1 for x in samples["healing_injected"] if float(x) < clean / 2.0),
        "mean_tokens_per_s": {
            **{k: _mean(samples[k]) for k in PHASE_SERIES},
            **{f"ladder_{k}": _mean(v) for k, v in ladder.items() if v},
        },
        "transitions_by_kind": dict(sorted(Counter(str(t["kind"]) for t in transitions).items())),
        "final_active": active,
        "ladder_tokens_per_s": lmed,
        "ladder_overhead": overhead,
        "ladder_overhead_4096": overhead.get("4096"),
        "ladder_paired_overhead": paired,
        "ladder_off_spread": stats.pair_noise(max(off), min(off)) if off else 0.0,
        "ladder_healing_samples_in_window": samples_in,
        "ladder_monitor_copies_in_window": copies_in,
        "ladder_overhead_4096_extrapolated_from_64": None if o64 is None else o64 * 64 / 4096,
    }


#: the fields of a hooked point that are inputs (everything else is computed)
POINT_INPUTS: tuple[str, ...] = (
    "family",
    "tokens",
    "routing",
    "routing_params",
    "seed",
    "routing_class",
    "decision",
    "path",
    "hook_stats",
    "equal_to_stock",
    "max_abs_diff_vs_stock",
    "calls_per_sample",
    "order_seed",
    "samples",
)
HOOKED_INPUTS: tuple[str, ...] = ("setup", "capture", "errors")
HEALING_INPUTS: tuple[str, ...] = (
    "setup",
    "samples",
    "slowed_calls",
    "transitions",
    "overrides",
    "stats",
    "warm_stats",
    "errors",
)


def flat_figures(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The figures targets name: ``hooked.<figure>`` and ``healing.<figure>``."""
    out: dict[str, Any] = {}
    for part in ("hooked", "healing"):
        for k, v in doc[part]["figures"].items():
            out[f"{part}.{k}"] = v
    return out


def build_serving(
    hooked: Mapping[str, Any],
    healing: Mapping[str, Any],
    *,
    milestone: str,
    fingerprint_hash: str,
    notes: Sequence[str] = (),
    schema_version: str = SERVING_VERSION,
) -> dict[str, Any]:
    """The ``serving.json`` document from the parts' inputs (:data:`POINT_INPUTS`,
    :data:`HOOKED_INPUTS`, :data:`HEALING_INPUTS`, and the healing part's ``ladder_counters``
    where present)."""
    points = [{**{k: p[k] for k in POINT_INPUTS}, **point_figures(p)} for p in hooked["points"]]
    small = int(hooked["setup"]["small_tokens_max"])
    h_part = {
        **{k: hooked[k] for k in HOOKED_INPUTS},
        "points": points,
        "figures": hooked_figures(points, hooked["capture"], small),
    }
    g_part = {
        **{k: healing[k] for k in HEALING_INPUTS},
        "figures": healing_figures(
            healing["setup"], healing["samples"], healing["transitions"], schema_version
        ),
    }
    if schema_version != "1.0":
        g_part["ladder_counters"] = healing.get("ladder_counters")
    doc: dict[str, Any] = {
        "schema": SERVING_SCHEMA,
        "schema_version": schema_version,
        "milestone": milestone,
        "fingerprint_hash": fingerprint_hash,
        "definitions": dict(DEFINITIONS if schema_version == "1.0" else DEFINITIONS_1_1),
        "notes": list(notes),
        "hooked": h_part,
        "healing": g_part,
    }
    doc["targets"] = build_targets(flat_figures(doc), targets_for(schema_version))
    return doc


# -- from the benchmark's raw files ---------------------------------------------------------


def _ints(d: Mapping[str, Any] | None) -> dict[str, int]:
    return {
        k: int(v) for k, v in (d or {}).items() if isinstance(v, int) and not isinstance(v, bool)
    }


def from_raw(
    hooked_raw: Mapping[str, Any],
    healing_raw: Mapping[str, Any],
    *,
    milestone: str = "h200-serving",
    notes: Sequence[str] = (),
    steps: int = 400,
    chunk: int = 25,
    warm_steps: int = 5,
    tail_chunks: int = 4,
    ladder_reps: int = 3,
) -> tuple[Fingerprint, dict[str, Any]]:
    """The fingerprint and ``serving.json`` for the raw ``hooked.json`` and ``healing.json``.

    ``steps``, ``chunk``, ``tail_chunks`` and ``ladder_reps`` are the healing run's options
    (the raw file does not record them; the defaults are ``benchmarks/serving.py``'s) and
    ``warm_steps`` its untimed steps per ladder install; each is checked against the raw
    file's chunk counts.  Raises EvidenceError on incomplete or inconsistent raw files.
    """
    fps = []
    for name, raw in (("hooked", hooked_raw), ("healing", healing_raw)):
        if not raw.get("fingerprint"):
            raise EvidenceError(f"the raw {name} file records no fingerprint")
        fp = Fingerprint(**raw["fingerprint"])
        if raw.get("fingerprint_hash") not in (None, fp.hash):
            raise EvidenceError(
                f"the raw {name} file's fingerprint_hash {raw.get('fingerprint_hash')} is not "
                f"the hash of its components ({fp.hash})"
            )
        fps.append(fp)
    if fps[0].hash != fps[1].hash:
        raise EvidenceError(
            f"the two raw files come from different environments ({fps[0].hash}, {fps[1].hash})"
        )
    missing = [k for k in ("clean", "static", "healing", "ladder") if not healing_raw.get(k)]
    if missing or not hooked_raw.get("points"):
        raise EvidenceError(
            f"cannot publish: the healing run lacks {missing or 'nothing'} and the hooked run "
            f"has {len(hooked_raw.get('points') or [])} points; re-run benchmarks/serving.py"
        )
    rounds = int(hooked_raw["rounds"])
    points = []
    for p in hooked_raw["points"]:
        e = p.get("eager_us") or {}
        if not all(len(e.get(k) or []) == rounds for k in ARMS):
            raise EvidenceError(f"point {label(p)} lacks {rounds} samples of every arm")
        points.append(
            {
                **{k: p[k] for k in POINT_INPUTS if k not in ("order_seed", "samples")},
                "hook_stats": _ints(p["hook_stats"]),
                "order_seed": int(p["tokens"]),  # eager_interleaved(..., seed=m)
                "samples": {k: e[k] for k in ARMS},
            }
        )
    hooked = {
        "setup": {
            "store_export": hooked_raw["store_export"],
            "store_import": _ints(hooked_raw.get("import")),
            "dispatch_fingerprint": hooked_raw["dispatch_fingerprint"],
            "dispatch_fingerprint_is_live": bool(hooked_raw["dispatch_fingerprint_is_live"]),
            "rounds": rounds,
            "trace_source": hooked_raw.get("trace_source", ""),
            "small_tokens_max": SMALL_TOKENS_MAX,
            "series": dict(SERIES),
            "wall_s": hooked_raw.get("wall_s"),
        },
        "points": points,
        "capture": hooked_raw.get("capture"),
        "errors": list(hooked_raw.get("errors") or []),
    }
    h = healing_raw
    static, heal = h["static"], h["healing"]
    expect = {
        "clean": (len(h["clean"]["tokens_per_s"]), steps // chunk),
        "static clean": (len(static["clean_tokens_per_s"]), steps // 2 // chunk),
        "static injected": (len(static["injected_tokens_per_s"]), steps // chunk),
        "healing clean": (len(heal["clean_tokens_per_s"]), steps // 2 // chunk),
        "healing injected": (len(heal["injected_tokens_per_s"]), 2 * steps // chunk),
        "static slowed calls": (int(static["slowed_calls"]), steps * len(h["slow_layers"])),
    }
    expect.update(
        {f"ladder {k}": (len(v), ladder_reps) for k, v in h["ladder"]["tokens_per_s"].items()}
    )
    wrong = {k: v for k, v in expect.items() if v[0] != v[1]}
    if wrong:
        raise EvidenceError(
            f"the healing run's chunk counts do not fit steps={steps}, chunk={chunk}, "
            f"ladder_reps={ladder_reps}: {wrong} (found, expected); pass the options it ran with"
        )
    healing = {
        "setup": {
            "model": h["model"],
            "tokens": h["tokens"],
            "routing_class": h["routing_class"],
            "factor": h["factor"],
            "slow_layers": h["slow_layers"],
            "target": h["target"],
            "alternatives": h["alternatives"],
            "steps": steps,
            "chunk": chunk,
            "warm_steps": warm_steps,
            "tail_chunks": tail_chunks,
            "sample_every": int(heal["options"]["sample_every"]),
            "ladder_reps": ladder_reps,
            "ladder_order": list(h["ladder"]["tokens_per_s"]),
            "store_export": h["store_export"],
            "store_import": _ints(h.get("import")),
            "dispatch_fingerprint": h["dispatch_fingerprint"],
            "wall_s": h.get("wall_s"),
            "decoder": h.get("decoder", "stack"),
            "model_check": h.get("model_check"),
            "ladder_steps": h["ladder"].get("steps"),
            "ladder_orders": h["ladder"].get("orders"),
            "ladder_persistent": h["ladder"].get("persistent"),
        },
        "samples": {
            "clean": h["clean"]["tokens_per_s"],
            "static_clean": static["clean_tokens_per_s"],
            "static_injected": static["injected_tokens_per_s"],
            "healing_clean": heal["clean_tokens_per_s"],
            "healing_injected": heal["injected_tokens_per_s"],
            "ladder": h["ladder"]["tokens_per_s"],
        },
        "slowed_calls": {
            "static": int(static["slowed_calls"]),
            "healing": int(heal["slowed_calls"]),
        },
        "transitions": [
            {k: t.get(k) for k in ("sample", "kind", "from", "to", "ratio", "key")}
            for t in heal.get("transitions", [])
        ],
        "overrides": list(heal.get("overrides") or []),
        "stats": _ints(heal.get("stats")),
        "warm_stats": _ints(h.get("warm_stats")),
        "errors": list(h.get("errors") or []),
        "ladder_counters": h["ladder"].get("counters"),
    }
    doc = build_serving(
        hooked, healing, milestone=milestone, fingerprint_hash=fps[0].hash, notes=notes
    )
    try:
        return fps[0], ServingDoc.model_validate(doc).to_json_dict()
    except ValidationError as exc:
        raise EvidenceError(
            f"the raw serving output does not fit {SERVING_SCHEMA} {SERVING_VERSION}: "
            f"{str(exc)[:600]}; check the raw files come from benchmarks/serving.py"
        ) from None


# -- the report -----------------------------------------------------------------------------


def _kv(d: Mapping[str, Any] | None) -> str:
    """A mapping as ``k v, ...`` in key order (the report does not depend on key order)."""
    if d is None:
        return "-"

    def text(v: Any) -> str:
        if isinstance(v, Mapping):
            return "{" + ", ".join(f"{k}: {text(v[k])}" for k in sorted(v)) + "}"
        return str(v)

    return ", ".join(f"{k} {text(d[k])}" for k in sorted(d))


def render_report(doc: Mapping[str, Any]) -> str:
    """``report.md``: a view of ``serving.json`` (the audit checks it is exactly this)."""
    hk, hl = doc["hooked"], doc["healing"]
    f, g = hk["figures"], hl["figures"]
    small = hk["setup"]["small_tokens_max"]
    lines = [
        f"# Serving path on the H200: {doc['milestone']}",
        "",
        "Every figure here is recomputed by `mxdb audit` from the raw samples in "
        "`serving.json`; the definitions are in its `definitions`.",
        "",
        "## Hooked eager call vs stock FlagGems eager call",
        "",
        f"- points: {f['n_points']} ({f['n_small_points']} at M <= {small}); paths: "
        f"{_kv(f['points_by_path'])}; hooked output equal to stock's at {f['points_equal_to_stock']}",
        f"- geomean speedup at M <= {small} (verdict's paired speedup): "
        f"{cell(f['small_geomean_speedup'])}x; by medians (the benchmark's printout): "
        f"{cell(f['small_geomean_median_ratio'])}x",
        f"- verdicts (mxdb.verdict.compare, {hk['setup']['rounds']} paired rounds): faster "
        f"{f['points_faster']}, same {f['points_same']}, slower {f['points_slower']}"
        + (f" ({', '.join(f['slower_points'])})" if f["slower_points"] else ""),
        f"- slower by the benchmark summary's median rule: {f['points_slower_by_median_rule']}"
        + (
            f" ({', '.join(f['slower_by_median_rule_points'])})"
            if f["slower_by_median_rule_points"]
            else ""
        ),
        f"- paired speedup below 1: {', '.join(f['below_one_points']) or 'none'}",
        f"- capture with monitor and healing on: {'ok' if f['capture_ok'] else 'FAILED'} "
        f"({_kv(hk['capture'])})",
        "",
        "| family | M | routing | class | path | entry | stock us | stock2 us | hooked us | "
        "speedup [95%] | noise | verdict | median ratio | stock after hooked / otherwise |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in hk["points"]:
        m = p["median_us"]
        lines.append(
            f"| {p['family']} | {p['tokens']} | {p['routing']} | {p['routing_class']} | "
            f"{p['path']} | {p['decision']['entry_id'] or '-'} | {cell(m['stock'], '.1f')} | "
            f"{cell(m['stock2'], '.1f')} | {cell(m['hooked'], '.1f')} | {cell(p['speedup'])} "
            f"[{cell(p['speedup_low'])}, {cell(p['speedup_high'])}] | {cell(p['noise_band'], '.4f')} | "
            f"{p['outcome']} | {cell(p['median_ratio'])} | "
            f"{cell(p['stock_median_us_after_hooked'], '.0f')} / "
            f"{cell(p['stock_median_us_otherwise'], '.0f')} |"
        )
    ladder = g["ladder_tokens_per_s"]
    lines += [
        "",
        "## Self-healing end to end",
        "",
        f"- model: {_kv(hl['setup']['model'])}; M={hl['setup']['tokens']} tokens per step, routing "
        f"class {hl['setup']['routing_class']}; injected: entry "
        f"{hl['setup']['target'].get('entry_id')} x{hl['setup']['factor']} on layers "
        f"{hl['setup']['slow_layers']}",
        f"- tokens/s: clean {cell(g['clean_tokens_per_s'], '.0f')}; injected without healing "
        f"{cell(g['static_injected_tokens_per_s'], '.0f')} ({cell(g['static_over_clean'])} of "
        f"clean); injected with healing, healed (last {hl['setup']['tail_chunks']} chunks) "
        f"{cell(g['healed_tokens_per_s'], '.0f')} ({cell(g['healed_over_clean'])} of clean, "
        f"{cell(g['healed_over_static'])}x static)",
        f"- transitions: {_kv(g['transitions_by_kind'])}; active candidate at the end: "
        f"{g['final_active']}; injected chunks below half of clean: {g['slow_chunks']} of "
        f"{len(hl['samples']['healing_injected'])}",
        "",
        "| ladder rung | tokens/s (median) | overhead | paired overhead | healing samples in "
        "window | monitor copies in window |",
        "|---|---|---|---|---|---|",
    ]
    for k in hl["setup"]["ladder_order"]:
        lines.append(
            f"| {k} | {cell(ladder.get(k), '.0f')} | {cell(g['ladder_overhead'].get(k), '+.4f')} | "
            f"{cell(g['ladder_paired_overhead'].get(k), '+.4f')} | "
            f"{g['ladder_healing_samples_in_window'].get(k)} | "
            f"{g['ladder_monitor_copies_in_window'].get(k)} |"
        )
    lines += [
        "",
        f"- off rung's run-to-run spread: {cell(g['ladder_off_spread'], '.4f')}; overhead at 4096 "
        f"extrapolated from the 64 rung: {cell(g['ladder_overhead_4096_extrapolated_from_64'], '.5f')}",
        "",
        "## Targets",
        "",
        *targets_markdown(doc["targets"]),
    ]
    if doc["notes"]:
        lines += ["", "## Notes", ""]
        for n in doc["notes"]:
            lines += [n, ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def notes_from_text(text: str) -> list[str]:
    """Paragraphs of a notes file (separated by blank lines), each joined into one line."""
    paras, cur = [], []
    for line in text.splitlines():
        if line.strip():
            cur.append(line.strip())
        elif cur:
            paras.append(" ".join(cur))
            cur = []
    if cur:
        paras.append(" ".join(cur))
    return paras
