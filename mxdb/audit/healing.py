"""The audit of a self-healing run (``self_healing.json``, ``mxdb.self-healing``).

Checks, on a schema-valid document: its fingerprint is the bundle's; the candidates' config
hashes are the hashes of their configs and each calibration median is the median of its
samples; each stream is three contiguous phases in order (normal, slowed, recovered), each of
``setup.calls_per_phase`` calls, with finite positive batch times; the injection slowed only
the slowed phase; the static stream never switched and the healing stream's per-batch active
candidate is the one its transitions imply; and every claimed figure (throughput per phase
and mode, the healing/static ratios, switch and recovery call indices and latencies, the
verdicts, the overhead per sampling interval) equals its recomputation from the raw batches
and repetitions with :func:`mxdb.evidence.healing.healing_figures`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from mxdb.audit.compare import Tol, same
from mxdb.audit.findings import FindingSink
from mxdb.configs import config_hash
from mxdb.errors import MxdbError
from mxdb.evidence import stats
from mxdb.evidence.healing import PHASES, healing_figures, replay_active
from mxdb.models import Fingerprint

#: At most this many per-batch findings of one check.
MAX_ROW_FINDINGS = 20
_BOOL_CLAIMS = ("demoted_while_slowed", "recovered_after_lift", "met")
_CALL_CLAIMS = (
    "switch_call",
    "recover_call",
    "switch_latency_calls",
    "recover_latency_calls",
    "false_switches",
)


def check_healing(
    sink: FindingSink, rel: str, doc: Mapping[str, Any], fingerprint_hash: str | None, tol: Tol
) -> None:
    """Audit one schema-valid ``mxdb.self-healing`` document; findings go to ``sink.add``."""
    fp_hash = Fingerprint(**doc["fingerprint"]).hash
    for want, what in ((fp_hash, "its components"), (fingerprint_hash, "fingerprint.json")):
        if want is not None and want != doc["fingerprint_hash"]:
            sink.add(
                "healing.fingerprint_mismatch",
                rel,
                "fingerprint_hash",
                want,
                doc["fingerprint_hash"],
                f"fingerprint hash is not that of {what}",
            )
    _check_calibration(sink, rel, doc, tol)
    ok = _check_streams(sink, rel, doc)
    if not ok:
        return  # figures over malformed streams would only repeat the findings above
    _check_claims(sink, rel, doc["claims"], healing_figures(doc), tol)


def _check_calibration(sink: FindingSink, rel: str, doc: Mapping[str, Any], tol: Tol) -> None:
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
    for i, run in enumerate(doc["calibration"]):
        where = f"calibration[{i}]"
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
        samples = [float(x) for x in run["samples_us"]]
        if not all(math.isfinite(x) and x > 0 for x in samples):
            sink.add(
                "healing.sample_invalid",
                rel,
                f"{where}.samples_us",
                "finite positive samples",
                [x for x in samples if not (math.isfinite(x) and x > 0)][:3],
                "a calibration sample is not a finite positive time",
            )
            continue
        med = stats.median(samples)
        if not same(med, run["median_us"], *tol):
            sink.add(
                "healing.calibration_mismatch",
                rel,
                f"{where}.median_us",
                med,
                run["median_us"],
                "calibration median is not the median of its samples",
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


def _check_streams(sink: FindingSink, rel: str, doc: Mapping[str, Any]) -> bool:
    ok = True
    setup = doc["setup"]
    modes = [s["mode"] for s in doc["streams"]]
    if sorted(modes) != ["healing", "static"]:
        sink.add(
            "healing.stream_invalid",
            rel,
            "streams",
            ["static", "healing"],
            modes,
            "a self-healing run compares one static and one healing stream",
        )
        return False
    for si, s in enumerate(doc["streams"]):
        where = f"streams[{si}]"
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
            ok = False
            continue
        prev_end: int | None = None
        bad = 0
        for pi, p in enumerate(s["phases"]):
            pw = f"{where}.phases[{pi}]"
            calls = sum(int(b["calls"]) for b in p["batches"])
            if calls != setup["calls_per_phase"]:
                sink.add(
                    "healing.stream_invalid",
                    rel,
                    f"{pw}.batches",
                    setup["calls_per_phase"],
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


def _check_claims(
    sink: FindingSink, rel: str, claims: Mapping[str, Any], rec: Mapping[str, Any], tol: Tol
) -> None:
    def diff(check: str, field: str, want: Any, got: Any, msg: str) -> None:
        if not same(want, got, *tol):
            sink.add(check, rel, f"claims.{field}", want, got, msg)

    for mode in sorted(set(rec["throughput"]) | set(claims["throughput"])):
        rp, cp = rec["throughput"].get(mode, {}), claims["throughput"].get(mode, {})
        for phase in sorted(set(rp) | set(cp)):
            r, c = rp.get(phase), cp.get(phase)
            if r is None or c is None:
                sink.add(
                    "healing.throughput_mismatch",
                    rel,
                    f"claims.throughput.{mode}.{phase}",
                    "present" if r else "absent",
                    "present" if c else "absent",
                    "claimed phases are not the recorded phases",
                )
                continue
            for k in ("calls", "gpu_s", "calls_per_s"):
                diff(
                    "healing.throughput_mismatch",
                    f"throughput.{mode}.{phase}.{k}",
                    r[k],
                    c[k],
                    "claimed throughput is not the recomputed one from the batches",
                )
    for phase in sorted(set(rec["ratio"]) | set(claims["ratio"])):
        diff(
            "healing.ratio_mismatch",
            f"ratio.{phase}",
            rec["ratio"].get(phase),
            claims["ratio"].get(phase),
            "claimed healing/static ratio is not the recomputed one",
        )
    for k in _CALL_CLAIMS:
        diff(
            "healing.transition_mismatch",
            k,
            rec[k],
            claims[k],
            "claimed call index is not the one the transitions give",
        )
    for mode in sorted(set(rec["overhead"]) | set(claims["overhead"])):
        r, c = rec["overhead"].get(mode), claims["overhead"].get(mode)
        for k in ("median_us_per_call", "overhead_us", "overhead_fraction"):
            diff(
                "healing.overhead_mismatch",
                f"overhead.{mode}.{k}",
                None if r is None else r[k],
                None if c is None else c[k],
                "claimed overhead is not the recomputed one from the repetitions",
            )
    for k in _BOOL_CLAIMS:
        diff(
            "healing.claim_mismatch",
            k,
            rec[k],
            claims[k],
            "claimed verdict is not the one the raw data support",
        )
