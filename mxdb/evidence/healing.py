"""Self-healing runs: static dispatch vs the healing runtime while one config slows down.

A self-healing bundle is a directory::

    manifest.json      mxdb.manifest      SHA-256 of every other file (written last)
    fingerprint.json   mxdb.fingerprint   the environment of the run
    self_healing.json  mxdb.self-healing  raw per-batch timings, transitions, the claims

``self_healing.json`` holds, for each stream (``static``: the FlagGems hook with a fixed
dispatch; ``healing``: the same hook with the self-healing runtime), three phases of layer
calls (``normal``; ``slowed``: the store's best config A slowed down by ``setup.slowdown``;
``recovered``: the slowdown lifted).  Each phase is a list of batches: the number of calls,
the GPU time the batch took (CUDA events at the batch boundaries, no synchronization inside
a phase) and the candidate index active at the end of the batch (0 = A, 1 = the next-best
B).  The healing stream also lists its transitions with the layer-call index at which each
was decided.  The calibration runs (per-call timings of A and B) give the medians recorded
in the store; the overhead runs give the eager time per layer call without the hook, with
the hook, and with healing samples every N calls.

:func:`healing_figures` recomputes every claim from those raw data; the writer stores its
result as ``claims`` and the auditor (``mxdb.audit.healing``) recomputes it again.
``build_document`` turns the raw output of ``benchmarks/self_healing.py run`` into the
document; ``write_healing_bundle`` writes the bundle atomically.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError

from mxdb.errors import EvidenceError
from mxdb.evidence import stats
from mxdb.evidence.models import _HEX16, _Doc
from mxdb.models import Fingerprint

HEALING_SCHEMA = "mxdb.self-healing"
HEALING_VERSION = "1.0"
HEALING_FILE = "self_healing.json"
PHASES: tuple[str, ...] = ("normal", "slowed", "recovered")
MODES: tuple[str, ...] = ("static", "healing")

DEFINITIONS: dict[str, str] = {
    "calls_per_s": "sum(batch calls) / sum(batch gpu_us) * 1e6 over a phase's batches; "
    "gpu_us is the CUDA-event time between consecutive batch boundaries of one eager stream",
    "ratio": "healing calls_per_s / static calls_per_s, per phase",
    "switch_call": "layer-call index (from 1, counted by the hook since its installation) of "
    "the first demote transition away from candidate 0 inside the healing stream's slowed phase",
    "recover_call": "layer-call index of the first recover transition back to candidate 0 "
    "after switch_call, inside the recovered phase",
    "switch_latency_calls": "switch_call - first call of the slowed phase",
    "recover_latency_calls": "recover_call - first call of the recovered phase",
    "false_switches": "transitions of the static stream plus transitions of the healing stream "
    "decided in its normal phase",
    "met": "the slowed config was demoted in the slowed phase and still demoted at its end, it "
    "was recovered in the recovered phase and active at its end, healing beat static while "
    "slowed (ratio > 1), and no false switches",
    "overhead": "per mode: median over the timed repetitions of (wall time / calls) of an eager "
    "run of calls_per_rep layer calls synchronized only at its ends; overhead_us = that minus "
    "the median of mode 'hooked' (hook installed, no healing samples); fraction = overhead_us / "
    "hooked median",
}


class HealingBatch(_Doc):
    """A batch of consecutive layer calls of one phase."""

    calls: int = Field(ge=1)
    gpu_us: float = Field(gt=0)
    active: int = Field(ge=0, description="candidate index active at the end of the batch")


class HealingPhase(_Doc):
    name: Literal["normal", "slowed", "recovered"]
    slowed: bool
    first_call: int = Field(ge=1, description="hook call index of the phase's first call")
    slowed_launches: int = Field(ge=0, description="GEMM launches the injection repeated")
    host_wall_s: float = Field(ge=0, description="host wall time of the phase (cross-check)")
    batches: list[HealingBatch] = Field(min_length=1)


class HealingTransition(_Doc):
    call: int = Field(ge=1)
    kind: Literal["demote", "exhausted", "recover"]
    from_index: int = Field(ge=0, alias="from")
    to_index: int = Field(ge=0, alias="to")
    ratio: float | None = None


class HealingStream(_Doc):
    mode: Literal["static", "healing"]
    phases: list[HealingPhase] = Field(min_length=3, max_length=3)
    transitions: list[HealingTransition] = Field(default_factory=list)
    counters: dict[str, Any] = Field(default_factory=dict)


class CalibrationRun(_Doc):
    """Per-call timings of one candidate, interleaved with the other; its median is stored."""

    label: str = Field(min_length=1)
    config: dict[str, Any]
    config_hash: str = Field(pattern=_HEX16)
    samples_us: list[float] = Field(min_length=1)
    median_us: float = Field(gt=0)


class OverheadMode(_Doc):
    mode: str = Field(min_length=1, description="unhooked, hooked or every_<N>")
    sample_every: int | None = Field(default=None, ge=1)
    us_per_call: list[float] = Field(min_length=1, description="one per timed repetition")
    samples_in_window: list[int] = Field(default_factory=list)


class Overhead(_Doc):
    shape: dict[str, Any]
    calls_per_rep: int = Field(ge=1)
    warm_reps: int = Field(ge=0)
    modes: list[OverheadMode] = Field(min_length=1)


class HealingSetup(_Doc):
    shape: dict[str, Any]
    slowdown: float = Field(gt=1)
    calls_per_phase: int = Field(ge=1)
    batch_calls: int = Field(ge=1)
    healing_options: dict[str, Any]
    candidates: list[str] = Field(min_length=2, description="labels, best first (A, B)")
    timing: str = Field(min_length=1)


class PhaseFigures(_Doc):
    calls: int
    gpu_s: float
    calls_per_s: float


class OverheadFigures(_Doc):
    median_us_per_call: float
    overhead_us: float | None
    overhead_fraction: float | None


class HealingClaims(_Doc):
    throughput: dict[str, dict[str, PhaseFigures]]
    ratio: dict[str, float]
    switch_call: int | None
    recover_call: int | None
    switch_latency_calls: int | None
    recover_latency_calls: int | None
    demoted_while_slowed: bool
    recovered_after_lift: bool
    false_switches: int
    overhead: dict[str, OverheadFigures]
    met: bool


class SelfHealingDoc(_Doc):
    """``self_healing.json``: raw data of a static-vs-healing run and the claims derived."""

    schema_name: Literal["mxdb.self-healing"] = Field(default="mxdb.self-healing", alias="schema")
    schema_version: Literal["1.0"] = "1.0"
    milestone: str = Field(min_length=1)
    created_at: str
    fingerprint: Fingerprint
    fingerprint_hash: str = Field(pattern=_HEX16)
    setup: HealingSetup
    calibration: list[CalibrationRun] = Field(min_length=2)
    streams: list[HealingStream] = Field(min_length=2, max_length=2)
    overhead: Overhead | None = None
    definitions: dict[str, str]
    notes: list[str] = Field(default_factory=list)
    claims: HealingClaims


# -- the figures ----------------------------------------------------------------------------


def _phase_figures(phase: Mapping[str, Any]) -> dict[str, Any]:
    calls = sum(int(b["calls"]) for b in phase["batches"])
    gpu_s = sum(float(b["gpu_us"]) for b in phase["batches"]) / 1e6
    return {"calls": calls, "gpu_s": gpu_s, "calls_per_s": calls / gpu_s if gpu_s > 0 else 0.0}


def _span(phase: Mapping[str, Any]) -> tuple[int, int]:
    first = int(phase["first_call"])
    return first, first + sum(int(b["calls"]) for b in phase["batches"]) - 1


def replay_active(stream: Mapping[str, Any]) -> list[tuple[str, int, int, int]]:
    """Per batch: (phase, index of the batch, its last call, the active index implied by the
    transitions decided up to that call)."""
    trans = sorted(stream.get("transitions", []), key=lambda t: int(t["call"]))
    active, k, out = 0, 0, []
    for phase in stream["phases"]:
        end = int(phase["first_call"]) - 1
        for i, b in enumerate(phase["batches"]):
            end += int(b["calls"])
            while k < len(trans) and int(trans[k]["call"]) <= end:
                active = int(trans[k]["to"])
                k += 1
            out.append((phase["name"], i, end, active))
    return out


def _overhead_figures(oh: Mapping[str, Any] | None) -> dict[str, Any]:
    if not oh:
        return {}
    meds = {m["mode"]: stats.median([float(x) for x in m["us_per_call"]]) for m in oh["modes"]}
    ref = meds.get("hooked")
    out: dict[str, Any] = {}
    for mode, med in meds.items():
        over = med - ref if ref is not None and mode != "hooked" else None
        if mode == "hooked":
            over = 0.0
        out[mode] = {
            "median_us_per_call": med,
            "overhead_us": over,
            "overhead_fraction": over / ref if over is not None and ref else None,
        }
    return out


def healing_figures(doc: Mapping[str, Any]) -> dict[str, Any]:
    """Every claim of a self-healing document, recomputed from its raw data (see DEFINITIONS)."""
    streams = {s["mode"]: s for s in doc["streams"]}
    throughput = {
        mode: {p["name"]: _phase_figures(p) for p in s["phases"]} for mode, s in streams.items()
    }
    ratio: dict[str, float] = {}
    if "static" in throughput and "healing" in throughput:
        for name in PHASES:
            st, he = throughput["static"].get(name), throughput["healing"].get(name)
            if st and he and st["calls_per_s"] > 0:
                ratio[name] = he["calls_per_s"] / st["calls_per_s"]
    heal = streams.get("healing")
    switch = recover = None
    demoted = recovered = False
    false_switches = len(streams["static"]["transitions"]) if "static" in streams else 0
    switch_lat = recover_lat = None
    if heal is not None:
        phases = {p["name"]: p for p in heal["phases"]}
        spans = {name: _span(p) for name, p in phases.items()}
        trans = sorted(heal.get("transitions", []), key=lambda t: int(t["call"]))
        if "normal" in spans:
            lo, hi = spans["normal"]
            false_switches += sum(1 for t in trans if int(t["call"]) <= hi)
        ends = {name: p["batches"][-1]["active"] for name, p in phases.items()}
        if "slowed" in spans:
            lo, hi = spans["slowed"]
            switch = next(
                (
                    int(t["call"])
                    for t in trans
                    if t["kind"] == "demote" and t["from"] == 0 and lo <= int(t["call"]) <= hi
                ),
                None,
            )
            if switch is not None:
                switch_lat = switch - lo
            demoted = switch is not None and ends["slowed"] != 0
        if "recovered" in spans and switch is not None:
            lo, hi = spans["recovered"]
            recover = next(
                (
                    int(t["call"])
                    for t in trans
                    if t["kind"] == "recover" and t["to"] == 0 and lo <= int(t["call"]) <= hi
                ),
                None,
            )
            if recover is not None:
                recover_lat = recover - lo
            recovered = recover is not None and ends["recovered"] == 0
    met = bool(demoted and recovered and ratio.get("slowed", 0.0) > 1.0 and false_switches == 0)
    return {
        "throughput": throughput,
        "ratio": ratio,
        "switch_call": switch,
        "recover_call": recover,
        "switch_latency_calls": switch_lat,
        "recover_latency_calls": recover_lat,
        "demoted_while_slowed": demoted,
        "recovered_after_lift": recovered,
        "false_switches": false_switches,
        "overhead": _overhead_figures(doc.get("overhead")),
        "met": met,
    }


# -- building and writing -----------------------------------------------------------------


def build_document(
    raw: Mapping[str, Any], *, milestone: str = "h200-self-healing"
) -> SelfHealingDoc:
    """The document for the raw output of ``benchmarks/self_healing.py run`` (``raw.json``).

    Raises EvidenceError when the raw output is incomplete (a stream missing, a phase without
    batches) or does not fit the document format.
    """
    missing = [k for k in ("fingerprint", "setup", "calibration", "streams") if not raw.get(k)]
    modes = sorted(s.get("mode", "?") for s in raw.get("streams") or [])
    if missing or modes != sorted(MODES):
        raise EvidenceError(
            f"cannot build a self-healing document: the raw output lacks {missing or 'nothing'} "
            f"and has streams {modes} (need {list(MODES)}); re-run benchmarks/self_healing.py "
            "run to completion (its status and errors are in raw.json)"
        )
    fp = Fingerprint(**raw["fingerprint"])
    body: dict[str, Any] = {
        "milestone": milestone,
        "created_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "fingerprint": fp.model_dump(mode="json"),
        "fingerprint_hash": fp.hash,
        "setup": raw["setup"],
        "calibration": raw["calibration"],
        "streams": raw["streams"],
        "overhead": raw.get("overhead"),
        "definitions": DEFINITIONS,
        "notes": list(raw.get("errors") or []),
    }
    body["claims"] = healing_figures(body)
    try:
        return SelfHealingDoc.model_validate(body)
    except ValidationError as exc:
        raise EvidenceError(
            f"the raw self-healing output does not fit {HEALING_SCHEMA} {HEALING_VERSION}: "
            f"{str(exc)[:600]}; check the raw file comes from benchmarks/self_healing.py"
        ) from None


def write_healing_bundle(
    out_dir: Path, doc: SelfHealingDoc, *, bundle_id: str | None = None
) -> Path:
    """Write fingerprint.json, self_healing.json and (last) manifest.json into an empty dir."""
    from mxdb.evidence.writer import write_document_bundle

    return write_document_bundle(
        out_dir,
        kind="self-healing",
        fingerprint=doc.fingerprint,
        file_name=HEALING_FILE,
        document=doc.to_json_dict(),
        milestone=doc.milestone,
        bundle_id=bundle_id,
    )


def medians(runs: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The median of each calibration run's samples, by label."""
    return {r["label"]: stats.median([float(x) for x in r["samples_us"]]) for r in runs}
