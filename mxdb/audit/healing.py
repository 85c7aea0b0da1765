"""The audit of a self-healing run (``self_healing.json``, ``mxdb.self-healing``), declared as
a claim kind.

Checks its fingerprint is that of its components and of the bundle; the calibration runs are
the candidates, best first, with distinct configs whose hashes they name and medians of their
samples; each stream is three contiguous phases in order (normal, slowed, recovered), each of
``setup.calls_per_phase`` calls, with finite batch times; the injection slowed only the slowed
phase; the static stream never switched and the healing stream's per-batch active candidate is
the one its transitions imply.  Every claim is then recomputed from the raw batches and
repetitions with :func:`mxdb.evidence.healing.healing_figures`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from mxdb.audit.claims import ClaimKind, Context, Path_, Unit
from mxdb.audit.findings import FindingSink
from mxdb.configs import config_hash
from mxdb.errors import MxdbError
from mxdb.evidence import stats
from mxdb.evidence.healing import MODES, PHASES, healing_figures, replay_active
from mxdb.models import Fingerprint

#: At most this many per-batch findings of one check.
MAX_ROW_FINDINGS = 20
#: claim -> finding code (the verdicts demoted_while_slowed, recovered_after_lift and met are
#: ``claim_mismatch``)
_CLAIM_CODES = {
    "throughput": "throughput_mismatch",
    "ratio": "ratio_mismatch",
    "overhead": "overhead_mismatch",
    "switch_call": "transition_mismatch",
    "recover_call": "transition_mismatch",
    "switch_latency_calls": "transition_mismatch",
    "recover_latency_calls": "transition_mismatch",
    "false_switches": "transition_mismatch",
}


def _two_modes(doc: Mapping[str, Any]) -> bool:
    return sorted(s["mode"] for s in doc["streams"]) == sorted(MODES)


def _preflight(sink: FindingSink, rel: str, doc: Mapping[str, Any], _: Context) -> bool:
    want = Fingerprint(**doc["fingerprint"]).hash
    if want != doc["fingerprint_hash"]:
        sink.add(
            "healing.fingerprint_mismatch",
            rel,
            "fingerprint_hash",
            want,
            doc["fingerprint_hash"],
            "fingerprint hash is not that of its components",
        )
    labels = [r["label"] for r in doc["calibration"]]
    if labels != list(doc["setup"]["candidates"]):
        sink.add(
            "healing.calibration_mismatch",
            rel,
            "calibration",
            doc["setup"]["candidates"],
            labels,
            "calibration runs are not the candidates, best first",
        )
    hashes = [r["config_hash"] for r in doc["calibration"]]
    if len(set(hashes)) != len(hashes):
        sink.add(
            "healing.config_mismatch",
            rel,
            "calibration",
            "distinct configs",
            hashes,
            "two candidates have the same config",
        )
    if not _two_modes(doc):
        sink.add(
            "healing.stream_invalid",
            rel,
            "streams",
            list(MODES),
            [s["mode"] for s in doc["streams"]],
            "a self-healing run compares one static and one healing stream",
        )
    return True  # the calibration is checked even when the streams are not comparable


def _calibration_ok(
    sink: FindingSink, rel: str, where: str, run: Mapping[str, Any], _: Context
) -> bool:
    try:
        h = config_hash(run["config"])
    except (MxdbError, ValueError, TypeError) as exc:
        h = f"invalid config: {exc}"[:80]
    if h != run["config_hash"]:
        sink.add(
            "healing.config_mismatch",
            rel,
            f"{where}.config_hash",
            h,
            run["config_hash"],
            "config hash is not the hash of the config",
        )
    bad = [x for x in run["samples_us"] if not stats.valid_sample(x)]
    if bad:
        sink.add(
            "healing.sample_invalid",
            rel,
            f"{where}.samples_us",
            "finite positive samples",
            bad[:3],
            "a calibration sample is not a finite positive time",
        )
    return not bad


def _stream_ok(sink: FindingSink, rel: str, where: str, s: Mapping[str, Any], ctx: Context) -> bool:
    if not _two_modes(ctx.doc):
        return False  # reported once, by the preflight
    names = [p["name"] for p in s["phases"]]
    if names != list(PHASES) or [p["slowed"] for p in s["phases"]] != [False, True, False]:
        sink.add(
            "healing.stream_invalid",
            rel,
            f"{where}.phases",
            list(PHASES),
            names,
            "phases are not normal, slowed (injected), recovered in that order",
        )
        return False
    ok = True
    per_phase = ctx.doc["setup"]["calls_per_phase"]
    prev_end: int | None = None
    bad = 0
    for pi, p in enumerate(s["phases"]):
        pw = f"{where}.phases[{pi}]"
        calls = sum(int(b["calls"]) for b in p["batches"])
        if calls != per_phase:
            sink.add(
                "healing.stream_invalid",
                rel,
                f"{pw}.batches",
                per_phase,
                calls,
                "a phase's batches do not add up to the calls per phase",
            )
            ok = False
        if prev_end is not None and int(p["first_call"]) != prev_end + 1:
            sink.add(
                "healing.stream_invalid",
                rel,
                f"{pw}.first_call",
                prev_end + 1,
                p["first_call"],
                "phases are not contiguous call ranges",
            )
            ok = False
        prev_end = int(p["first_call"]) + calls - 1
        for bi, b in enumerate(p["batches"]):
            if not math.isfinite(float(b["gpu_us"])) and bad < MAX_ROW_FINDINGS:
                bad += 1
                sink.add(
                    "healing.sample_invalid",
                    rel,
                    f"{pw}.batches[{bi}].gpu_us",
                    "a finite positive time",
                    b["gpu_us"],
                    "a batch time is not a finite positive number",
                )
                ok = False
        slowed = int(p["slowed_launches"]) > 0
        if s["mode"] == "static" and slowed != bool(p["slowed"]):
            sink.add(
                "healing.injection_mismatch",
                rel,
                f"{pw}.slowed_launches",
                "> 0" if p["slowed"] else 0,
                p["slowed_launches"],
                "the static stream's slowdown injection does not match its phase",
            )
        elif not p["slowed"] and slowed:
            sink.add(
                "healing.injection_mismatch",
                rel,
                f"{pw}.slowed_launches",
                0,
                p["slowed_launches"],
                "launches were slowed outside the slowed phase",
            )
    if s["mode"] == "static" and s["transitions"]:
        sink.add(
            "healing.transition_mismatch",
            rel,
            f"{where}.transitions",
            [],
            len(s["transitions"]),
            "the static stream has no healing and cannot switch",
        )
    calls_seen = [int(t["call"]) for t in s["transitions"]]
    if calls_seen != sorted(calls_seen):
        sink.add(
            "healing.transition_mismatch",
            rel,
            f"{where}.transitions",
            "in call order",
            calls_seen[:10],
            "transitions are not in call order",
        )
    mism = 0
    flat = [b for p in s["phases"] for b in p["batches"]]
    for (phase, bi, end, want), b in zip(replay_active(s), flat, strict=True):
        if int(b["active"]) != want:
            mism += 1
            if mism <= MAX_ROW_FINDINGS:
                sink.add(
                    "healing.transition_mismatch",
                    rel,
                    f"{where}.{phase}.batches[{bi}].active",
                    want,
                    b["active"],
                    f"active candidate at call {end} is not what the transitions imply",
                )
    return ok


def _code(path: Path_) -> str:
    if path[0] == "calibration":
        return "calibration_mismatch"
    return _CLAIM_CODES.get(str(path[1]) if len(path) > 1 else "", "claim_mismatch")


KIND = ClaimKind(
    name="healing",
    document="self_healing.json",
    schema="mxdb.self-healing",
    codes=_code,
    units=(
        Unit(
            "calibration",
            check=_calibration_ok,
            figures=lambda r, _: {"median_us": stats.median([float(x) for x in r["samples_us"]])},
        ),
        Unit("streams", check=_stream_ok),
    ),
    figures=lambda doc, _: {"claims": healing_figures(doc)},
    preflight=_preflight,
)
