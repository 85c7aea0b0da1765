"""The learned model checked on families it never saw (``check.json``, ``mxdb.perf-check`` 1.0).

The question: for shape families the performance model never saw (each family's answers come
from the model trained *without* it), is the model's dispatch faster than FlagGems' own choice
on held-out routing, never slower, and is its stated confidence calibrated?

Inputs (``benchmarks/perf_check.py``):

- ``plan``: what each family's leave-one-family-out model answers at every (token count,
  routing class), as :func:`mxdb.costmodel.train.lofo_plan` returns it: the config (None:
  FlagGems' own choice), its predicted speedup, the trees' agreement, the confidence stated by
  the calibration fitted on the other families, and whether the gate answers it;
- ``points``: per family, token count, routing source and instance, a routing instance drawn
  from a generator neither the sweep nor the tuner uses (``mxdb.routing_gen`` kind ``logits``,
  recorded as its seed and parameters, with its expert counts, routing class and trace hash),
  and the raw samples of FlagGems' own choice timed three times (one ``baseline`` and two
  ``control`` arms) beside the plan's config for the instance's class (the ``candidate`` arm;
  absent where the plan answers FlagGems' own choice), 8 rounds in a random order per round,
  CUDA-graph replay.  A config the gate does not answer is timed too: its outcome is what the
  confidence stated for it is checked against.

Derived per point (:func:`point_figures`; the auditor recomputes it with this function):

- ``median_us`` of every arm (None for an arm without samples);
- ``plan_entry``: the plan's entry for the point's (family, token count, routing class);
- ``candidate_speedup``, ``noise_band`` and ``outcome``: :func:`mxdb.verdict.compare` of the
  candidate against the three copies of FlagGems' choice, margin 0.005 (``outcome`` is
  ``faster``, ``same`` or ``slower``; ``failed`` where the candidate did not run or computed a
  wrong result, ``untimed`` where the copies give no paired rounds, None without a candidate);
- ``answered`` and ``confidence``: the plan entry's;
- ``dispatch_speedup``: what the model's dispatch gains there: the candidate's speedup where
  the gate answers, 1.0 where it does not (FlagGems' own choice runs), None where it answers a
  candidate that has no speedup (``failed`` or ``untimed``; counted in ``answered_failed``).

Figures (:func:`build_figures`): the counts of points, answered points, points that timed a
candidate, answered points faster, slower and failed; the geometric mean of the dispatch
speedup over every point with one (a fallback counts 1.0) and of the candidate speedup over
the answered points; the calibration error (:func:`mxdb.costmodel.calibration.calibration_error`)
of the pairs (stated confidence, outcome is ``faster``) of every point that timed a candidate,
with their mean stated confidence and win rate; per family (points, answered, answered faster
and slower, geomean dispatch speedup) and per bin of stated confidence (the calibration
error's bins: count, mean stated confidence, win rate).

Targets (:data:`TARGETS`): geomean dispatch speedup at least 1.03, no answered point slower,
calibration error at most 0.05.  A missed target is a recorded fact; a document claiming a
missed target met is an audit finding.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from mxdb import verdict
from mxdb.costmodel.calibration import BINS, calibration_error
from mxdb.evidence import stats
from mxdb.evidence.cells import cell
from mxdb.evidence.models import KNOWN_VERSIONS, ShapeDoc, _Doc
from mxdb.evidence.peers import Target, TargetSpec, build_targets, targets_markdown

CHECK_FILE = "check.json"
REPORT_FILE = "report/check.md"
SCHEMA = "mxdb.perf-check"
SCHEMA_VERSION = "1.0"
#: the file of each sibling bundle the document names, and the document it must declare
MODEL_FILE = "model.json"
MODEL_SCHEMA = "mxdb.perf-model"
SWEEP_FILE = "sweep.json"
SWEEP_SCHEMA = "mxdb.perf-sweep"
#: the verdict's margin of "faster" / "slower" (the tuner's default verify margin)
MARGIN = 0.005
#: how every point was measured (fixed: the auditor checks a document's settings)
SETTINGS: dict[str, Any] = {
    "rounds": 8,
    "copies": 3,
    "instances": 3,
    "margin": MARGIN,
    "method": "graph",
    "generator": "logits",
}
#: the roles of a point's arms: FlagGems' own choice (baseline, controls), the plan's config
COPY_ROLES: tuple[str, ...] = ("baseline", "control")
OUTCOMES: tuple[str, ...] = ("faster", "same", "slower", "failed", "untimed")

# the auditor reads the versions it understands from this table
KNOWN_VERSIONS.setdefault(SCHEMA, (SCHEMA_VERSION,))

#: The check's targets (fixed here: the auditor checks a document's thresholds).
TARGETS: tuple[TargetSpec, ...] = (
    TargetSpec(
        name="dispatch_geomean",
        figure="geomean_dispatch_speedup",
        comparison="ge",
        threshold=1.03,
        statement="GPU time on held-out routing, for families the model never saw: geomean "
        "speedup of the model's dispatch over FlagGems' own choice of at least 1.03x over all "
        "points (a fallback counts 1.0)",
    ),
    TargetSpec(
        name="answered_never_slower",
        figure="answered_slower",
        comparison="le",
        threshold=0.0,
        statement="no point where the gate answers a config that is slower than FlagGems' own "
        "choice (mxdb.verdict, margin 0.005, beyond the noise of its copies)",
    ),
    TargetSpec(
        name="confidence_calibrated",
        figure="calibration_error",
        comparison="le",
        threshold=0.05,
        statement="the stated confidence is calibrated: expected calibration error (10 bins) of "
        "at most 0.05 against the measured outcomes of every timed candidate",
    ),
)

RoutingClass = Literal["uniform", "skewed", "hot", "sparse"]
_HEX16 = r"^[0-9a-f]{16}$"
_HEX64 = r"^[0-9a-f]{64}$"
_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class BundleRef(_Doc):
    """A sibling bundle (a folder beside this one) and the SHA-256 of its document."""

    bundle: str = Field(pattern=_NAME, description="the folder's name, beside this bundle")
    sha256: str = Field(pattern=_HEX64, description="SHA-256 of its model.json / sweep.json")


class GateDoc(_Doc):
    """The model's gate: an answer needs both this confidence and this predicted speedup."""

    min_confidence: float
    min_speedup: float


class Settings(_Doc):
    """How every point was measured (:data:`SETTINGS`)."""

    rounds: int = Field(ge=1)
    copies: int = Field(ge=2)
    instances: int = Field(ge=1)
    margin: float
    method: str
    generator: str


class PlanEntry(_Doc):
    """A leave-one-family-out answer (``mxdb.costmodel.train.lofo_plan``)."""

    family: str
    tokens: int = Field(ge=1)
    routing_class: RoutingClass
    config: dict[str, Any] | None = Field(description="None: FlagGems' own choice")
    predicted: float = Field(description="predicted lower-quartile speedup over the trees")
    agreement: float = Field(description="share of the trees predicting it faster")
    confidence: float | None = Field(description="the calibrated confidence that it is faster")
    answered: bool = Field(description="whether the gate answers it")


class RoutingDoc(_Doc):
    """How an instance's top-k ids were generated (``mxdb.routing_gen.generate``)."""

    kind: str
    seed: int = Field(ge=0)
    params: dict[str, float | int]


class Arm(_Doc):
    """One timed config of a point: its raw samples (us per call, one per round)."""

    config: dict[str, Any]
    role: Literal["baseline", "control", "candidate"]
    status: Literal["ok", "oor", "compile_error", "timeout", "wrong"]
    samples: list[float]
    error: str | None
    median_us: float | None = Field(description="derived: the median of the samples")


class CheckPoint(_Doc):
    """One routing instance at one (family, token count, source): inputs, samples, figures."""

    family: str
    shape: ShapeDoc
    tokens: int = Field(ge=1)
    source: str = Field(description="the held-out routing source (uniform, zipf, hot)")
    instance: int = Field(ge=0)
    routing: RoutingDoc
    trace_hash: str = Field(pattern=_HEX16)
    counts: list[int] = Field(description="tokens routed to each expert")
    routing_class: RoutingClass
    baseline: dict[str, Any] = Field(description="FlagGems' own choice at the shape")
    calls_per_sample: int = Field(ge=1)
    arms: list[Arm] = Field(min_length=1)
    plan_entry: PlanEntry
    candidate_speedup: float | None
    noise_band: float | None
    outcome: Literal["faster", "same", "slower", "failed", "untimed"] | None
    answered: bool
    dispatch_speedup: float | None
    confidence: float | None


class FamilyFigures(_Doc):
    """The figures of one family's points."""

    points: int
    answered: int
    answered_faster: int
    answered_slower: int
    geomean_dispatch_speedup: float | None


class ConfidenceBin(_Doc):
    """One bin of stated confidence ``[low, high)`` (the last one includes 1.0)."""

    low: float
    high: float
    count: int
    mean_confidence: float | None
    win_rate: float | None


class CheckFigures(_Doc):
    """The document's figures (module docstring)."""

    points: int
    answered: int
    candidates_timed: int
    answered_faster: int
    answered_slower: int
    answered_failed: int
    geomean_dispatch_speedup: float | None
    geomean_answered_speedup: float | None
    calibration_error: float | None
    mean_confidence: float | None
    win_rate: float | None
    by_family: dict[str, FamilyFigures]
    confidence_bins: list[ConfidenceBin]


class CheckDoc(_Doc):
    """``check.json``: the held-out check of one performance model."""

    schema_name: Literal["mxdb.perf-check"] = Field(default="mxdb.perf-check", alias="schema")
    schema_version: Literal["1.0"] = "1.0"
    milestone: str = Field(min_length=1)
    fingerprint_hash: str
    model: BundleRef
    sweep: BundleRef
    gate: GateDoc
    settings: Settings
    plan: list[PlanEntry]
    points: list[CheckPoint]
    figures: CheckFigures
    targets: list[Target]
    errors: list[str]


PlanKey = tuple[str, int, str]


def plan_key(e: Mapping[str, Any]) -> PlanKey:
    """The key a plan entry answers, and a point looks its entry up by."""
    return (str(e["family"]), int(e["tokens"]), str(e["routing_class"]))


def plan_index(plan: Iterable[Mapping[str, Any]]) -> dict[PlanKey, Mapping[str, Any]]:
    """The plan's entries by key (the first of duplicates; the auditor reports those)."""
    out: dict[PlanKey, Mapping[str, Any]] = {}
    for e in plan:
        out.setdefault(plan_key(e), e)
    return out


def file_sha256(path: Path) -> str:
    """SHA-256 (hex) of a file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _candidate(arms: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    return next((a for a in arms if a["role"] == "candidate"), None)


def point_figures(
    p: Mapping[str, Any], plan: Mapping[PlanKey, Mapping[str, Any]], margin: float = MARGIN
) -> dict[str, Any]:
    """A point's derived fields from its arms' samples and its plan entry (module docstring)."""
    key = plan_key(p)
    entry = plan.get(key)
    if entry is None:
        raise ValueError(f"the plan has no entry for {key}: a point needs its plan's answer")
    arms = [
        {**a, "median_us": stats.median(a["samples"]) if a["samples"] else None} for a in p["arms"]
    ]
    copies = [a["samples"] for a in p["arms"] if a["role"] in COPY_ROLES]
    cand = _candidate(p["arms"])
    speedup: float | None = None
    outcome: str | None = None
    if cand is None:
        band = verdict.noise_band(copies)
    elif cand["status"] != "ok":
        band, outcome = verdict.noise_band(copies), "failed"
    else:
        v = verdict.compare(copies, cand["samples"], margin=margin)
        band, speedup = v.noise_band, v.speedup
        outcome = v.outcome if v.speedup is not None else "untimed"
    answered = bool(entry["answered"])
    return {
        "arms": arms,
        "plan_entry": dict(entry),
        "candidate_speedup": speedup,
        "noise_band": band,
        "outcome": outcome,
        "answered": answered,
        "dispatch_speedup": (speedup if answered else 1.0),
        "confidence": entry["confidence"],
    }


def timed_choices(points: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The points that timed a candidate with a stated confidence: what the calibration error
    is taken over, and what a model calibrated on the check is fitted on."""
    return [p for p in points if p["candidate_speedup"] is not None and p["confidence"] is not None]


def calibration_pairs(points: Iterable[Mapping[str, Any]]) -> list[tuple[float, bool]]:
    """(stated confidence, outcome is ``faster``) of every point that timed a candidate."""
    return [(float(p["confidence"]), p["outcome"] == "faster") for p in timed_choices(points)]


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def confidence_bins(pairs: Sequence[tuple[float, bool]], bins: int = BINS) -> list[dict[str, Any]]:
    """Per bin of stated confidence (the calibration error's: ``[b / bins, (b + 1) / bins)``,
    the last one with 1.0): count, mean stated confidence, win rate."""
    out = []
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        inb = [(c, w) for c, w in pairs if lo <= c < hi or (b == bins - 1 and c == 1.0)]
        out.append({
            "low": lo, "high": hi, "count": len(inb),
            "mean_confidence": _mean([c for c, _ in inb]),
            "win_rate": _mean([1.0 if w else 0.0 for _, w in inb]),
        })  # fmt: skip
    return out


def _family(points: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    answered = [p for p in points if p["answered"]]
    return {
        "points": len(points),
        "answered": len(answered),
        "answered_faster": sum(p["outcome"] == "faster" for p in answered),
        "answered_slower": sum(p["outcome"] == "slower" for p in answered),
        "geomean_dispatch_speedup": stats.geomean(
            p["dispatch_speedup"] for p in points if p["dispatch_speedup"] is not None
        ),
    }


def build_figures(points: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The document's figures from its points' derived fields (module docstring)."""
    answered = [p for p in points if p["answered"]]
    pairs = calibration_pairs(points)
    families = sorted({str(p["family"]) for p in points})
    return {
        **_family(points),
        "candidates_timed": sum(p["candidate_speedup"] is not None for p in points),
        "answered_failed": sum(p["candidate_speedup"] is None for p in answered),
        "geomean_answered_speedup": stats.geomean(
            p["candidate_speedup"] for p in answered if p["candidate_speedup"] is not None
        ),
        "calibration_error": calibration_error(pairs),
        "mean_confidence": _mean([c for c, _ in pairs]),
        "win_rate": _mean([1.0 if w else 0.0 for _, w in pairs]),
        "by_family": {f: _family([p for p in points if p["family"] == f]) for f in families},
        "confidence_bins": confidence_bins(pairs),
    }


def build_check(
    points: Sequence[Mapping[str, Any]],
    *,
    plan: Sequence[Mapping[str, Any]],
    model: Mapping[str, Any],
    model_bundle: Path,
    sweep_bundle: Path,
    milestone: str,
    fingerprint_hash: str,
    errors: Sequence[str] = (),
) -> dict[str, Any]:
    """The whole document from the plan, the raw points and the model's bundles (every figure
    derived); ``model`` is the parsed ``model.json`` of ``model_bundle`` (its gate)."""
    index = plan_index(plan)
    full = [{**p, **point_figures(p, index)} for p in points]
    figures = build_figures(full)
    gate = model["gate"]
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "milestone": milestone,
        "fingerprint_hash": fingerprint_hash,
        "model": {"bundle": Path(model_bundle).name,
                  "sha256": file_sha256(Path(model_bundle) / MODEL_FILE)},
        "sweep": {"bundle": Path(sweep_bundle).name,
                  "sha256": file_sha256(Path(sweep_bundle) / SWEEP_FILE)},
        "gate": {"min_confidence": float(gate["min_confidence"]),
                 "min_speedup": float(gate["min_speedup"])},
        "settings": dict(SETTINGS),
        "plan": [dict(e) for e in plan],
        "points": full,
        "figures": figures,
        "targets": build_targets(figures, TARGETS),
        "errors": list(errors),
    }  # fmt: skip


def _speedup(x: float | None) -> str:
    return cell(x, ".3f") + ("x" if x is not None else "")


def render(doc: Mapping[str, Any]) -> str:
    """``report/check.md``: a view of ``check.json`` (the audit checks the JSON)."""
    f = doc["figures"]
    s = doc["settings"]
    g = doc["gate"]
    lines = [
        "# The performance model on families it never saw",
        "",
        f"Model `{doc['model']['bundle']}` (model.json {doc['model']['sha256'][:16]}), trained "
        f"on sweep `{doc['sweep']['bundle']}` (sweep.json {doc['sweep']['sha256'][:16]}). Each "
        "family's answers come from the model trained without that family, with the confidence "
        "of the calibration fitted on the other families; the gate answers a config when its "
        f"confidence is at least {g['min_confidence']:g} and its predicted speedup at least "
        f"{g['min_speedup']:g}x, else FlagGems' own choice runs.",
        "",
        f"Held-out routing: generator `{s['generator']}`, {s['instances']} instances per family, "
        f"token count and source; each timed against {s['copies']} copies of FlagGems' own "
        f"choice, {s['rounds']} rounds in a random order per round ({s['method']} replay); "
        f"verdict margin {s['margin']:g}.",
        "",
        f"Points: {f['points']}, answered {f['answered']} (faster {f['answered_faster']}, slower "
        f"{f['answered_slower']}, failed {f['answered_failed']}), candidates timed "
        f"{f['candidates_timed']}.",
        f"Geomean speedup of the dispatch over FlagGems' own choice: "
        f"{_speedup(f['geomean_dispatch_speedup'])} over all points (a fallback counts 1.0), "
        f"{_speedup(f['geomean_answered_speedup'])} over the answered points.",
        f"Calibration: error {cell(f['calibration_error'])}, mean stated confidence "
        f"{cell(f['mean_confidence'])}, win rate {cell(f['win_rate'])}.",
        "",
        *targets_markdown(doc["targets"]),
        "",
        "| family | points | answered | faster | slower | geomean dispatch speedup |",
        "|---|---|---|---|---|---|",
    ]
    for fam, r in f["by_family"].items():
        lines.append(
            f"| {fam} | {r['points']} | {r['answered']} | {r['answered_faster']} | "
            f"{r['answered_slower']} | {_speedup(r['geomean_dispatch_speedup'])} |"
        )
    lines += [
        "",
        "| stated confidence | timed candidates | mean stated | win rate |",
        "|---|---|---|---|",
    ]
    for b in f["confidence_bins"]:
        if b["count"]:
            lines.append(
                f"| [{b['low']:.1f}, {b['high']:.1f}) | {b['count']} | "
                f"{cell(b['mean_confidence'])} | {cell(b['win_rate'])} |"
            )
    bad = [p for p in doc["points"] if p["answered"] and p["outcome"] in ("slower", "failed",
                                                                          "untimed")]  # fmt: skip
    if bad:
        lines += [
            "",
            "Answered points slower than FlagGems' own choice, or without a speedup:",
            "",
            "| family | M | source | instance | class | outcome | speedup | noise band |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for p in bad:
            lines.append(
                f"| {p['family']} | {p['tokens']} | {p['source']} | {p['instance']} | "
                f"{p['routing_class']} | {p['outcome']} | {_speedup(p['candidate_speedup'])} | "
                f"{cell(p['noise_band'], '.4f')} |"
            )
    if doc["errors"]:
        lines += ["", "Errors:", *(f"- {e}" for e in doc["errors"])]
    return "\n".join(lines) + "\n"
