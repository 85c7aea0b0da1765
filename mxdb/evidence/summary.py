"""The milestone summary: one pure function from runs to every derived figure.

``summarize`` works on run documents as plain dicts (as written to and read from
``runs/*.json``), so that the writer and the auditor share it and the auditor needs no
pydantic per run.  Rules:

- A comparison group is (op, dtype, family, token count M, routing class).
- A run's median is recomputed from its raw samples; a run with no samples or any sample
  that is not a finite positive number has no usable time.
- The baseline is the group's ``baseline`` run (status ok, usable time).
- Control runs sharing a ``pair_id`` form an A-vs-A pair; the group's noise band is the
  largest pair noise (``mxdb.evidence.stats.pair_noise``).  Control runs never compete for
  the best candidate and never enter a speedup mean.
- The best candidate has role ``candidate``, status ok, passes the dtype's correctness
  thresholds (recomputed, not the recorded flag), a usable time, and a config other than the
  baseline's (a same-config comparison is a control, not a speedup); lowest median wins,
  ties go to the smaller run id.
- ``speedup = median(baseline) / median(best)``; verified when ``speedup - 1 > noise band``
  (no noise band, no verification).
- Failures are runs with status oor, compile_error, wrong or timeout, in any role.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mxdb import pointverdict, verdict
from mxdb.errors import EvidenceError
from mxdb.evidence import stats
from mxdb.evidence.models import FAILURE_STATUSES, SCHEMA_VERSION
from mxdb.evidence.thresholds import THRESHOLDS, passes
from mxdb.fileio import load_json
from mxdb.models import MEASUREMENT_STATUSES
from mxdb.shapes import memory_floor_bytes

ROLES: tuple[str, ...] = ("baseline", "candidate", "control", "peer")

Run = Mapping[str, Any]


def family_of(shape: Mapping[str, Any]) -> str:
    """``MoEShape.family`` of a shape dict: ``E<experts>-H<hidden>-I<intermediate>-k<topk>``."""
    s = shape
    return f"E{s['experts']}-H{s['hidden']}-I{s['intermediate']}-k{s['topk']}"


def group_key(run: Run) -> str:
    """The comparison group of a run.

    Runs of a tuning point (run schema 1.1, with ``point``): ``<point>/<comparison>``, one
    interleaved comparison on one routing instance.  Earlier runs:
    ``op/dtype/E..-H..-I..-k../M<tokens>/<routing class>``.
    """
    if run.get("point"):
        return f"{run['point']}/{run.get('comparison') or 'replay'}"
    s = run["shape"]
    return f"{run['op']}/{s['dtype']}/{family_of(s)}/M{s['tokens']}/{run['routing_class']}"


def usable_median(run: Run) -> float | None:
    """The median recomputed from the raw samples, or ``None`` when they cannot be trusted."""
    timing = run.get("timing")
    if not timing:
        return None
    samples = timing.get("samples_us") or []
    if not samples or not all(stats.valid_sample(x) for x in samples):
        return None
    return stats.median(samples)


def run_passes(run: Run) -> bool:
    """The correctness verdict recomputed from the recorded errors and the dtype's thresholds."""
    corr = run.get("correctness")
    dtype = run["shape"]["dtype"]
    if not corr or dtype not in THRESHOLDS:
        return False
    return passes(dtype, corr.get("max_abs_err"), corr.get("rel_err"))


def _summarize_group(
    key: str,
    runs: list[Run],
    active_experts: Mapping[str, int],
    bandwidth: float | None,
) -> dict[str, Any]:
    runs = sorted(runs, key=lambda r: r["run_id"])
    first = runs[0]
    shape = first["shape"]
    medians = {r["run_id"]: usable_median(r) for r in runs}

    baselines = [r for r in runs if r["role"] == "baseline"]
    baseline = baselines[0] if baselines else None
    base_med = None
    if baseline is not None and baseline["status"] == "ok":
        base_med = medians[baseline["run_id"]]

    pairs: dict[str, list[Run]] = defaultdict(list)
    for r in runs:
        if r["role"] == "control":
            pairs[str(r.get("pair_id"))].append(r)
    control_pairs = [sorted(x["run_id"] for x in p) for _, p in sorted(pairs.items())]
    noises = []
    for p in pairs.values():
        if len(p) != 2 or p[0]["config_hash"] != p[1]["config_hash"]:
            continue
        ma, mb = medians[p[0]["run_id"]], medians[p[1]["run_id"]]
        if ma is None or mb is None or p[0]["status"] != "ok" or p[1]["status"] != "ok":
            continue
        noises.append(stats.pair_noise(ma, mb))
    noise_band = max(noises) if noises else None

    base_hash = baseline["config_hash"] if baseline is not None else None
    best: Run | None = None
    best_med: float | None = None
    for r in runs:
        m = medians[r["run_id"]]
        if (
            r["role"] != "candidate"
            or r["status"] != "ok"
            or m is None
            or r["config_hash"] == base_hash
            or not run_passes(r)
        ):
            continue
        if best_med is None or m < best_med:
            best, best_med = r, m

    speedup = None
    if base_med is not None and best_med is not None:
        speedup = stats.speedup(base_med, best_med)
    verified = verdict.legacy_verified(speedup, noise_band)
    interval: dict[str, Any] = {}
    if first.get("point"):
        best, best_med, speedup, noise_band, verified, interval = _judged(runs, baseline, medians)

    floor_us = floor_fraction = None
    traces = sorted({r["trace_hash"] for r in runs if r.get("trace_hash")})
    if bandwidth:
        active = active_experts.get(traces[0]) if len(traces) == 1 else None
        if active is None:
            active = min(shape["experts"], shape["topk"] * shape["tokens"])
        floor_bytes = memory_floor_bytes(
            active, shape["hidden"], shape["intermediate"], shape["dtype"]
        )
        floor_us = floor_bytes / bandwidth * 1e6
        ref = best_med if best_med is not None else base_med
        floor_fraction = floor_us / ref if ref else None

    return {
        "key": key,
        "op": first["op"],
        "family": family_of(shape),
        "dtype": shape["dtype"],
        "tokens": shape["tokens"],
        "routing_class": first["routing_class"],
        "trace_hashes": traces,
        "baseline_run": baseline["run_id"] if baseline is not None else None,
        "baseline_median_us": base_med,
        "candidate_runs": [r["run_id"] for r in runs if r["role"] == "candidate"],
        "control_pairs": control_pairs,
        "noise_band": noise_band,
        "best_run": best["run_id"] if best is not None else None,
        "best_config_hash": best["config_hash"] if best is not None else None,
        "best_median_us": best_med,
        "speedup": speedup,
        "verified": verified,
        "failures": [r["run_id"] for r in runs if r["status"] in FAILURE_STATUSES],
        "floor_us": floor_us,
        "floor_fraction": floor_fraction,
        **interval,
    }


def _judged(
    runs: list[Run], baseline: Run | None, medians: Mapping[str, float | None]
) -> tuple[Run | None, float | None, float | None, float | None, bool, dict[str, Any]]:
    """A comparison of run schema 1.1, judged by the one verdict rule (``mxdb.verdict``)."""
    empty: dict[str, Any] = {"speedup_low": None, "speedup_high": None}
    if baseline is None:
        return None, None, None, None, False, empty
    arms = [pointverdict.arm_from_run(r, run_passes(r)) for r in runs]
    _, copies = pointverdict.copies_of(arms)
    if not copies:
        return None, None, None, None, False, empty
    samples = [list(a.samples) for a in copies]
    best: Run | None = None
    best_v: verdict.Verdict | None = None
    for r, a in zip(runs, arms, strict=True):
        if r["role"] not in ("candidate", "peer") or r["config_hash"] == baseline["config_hash"]:
            continue
        if not pointverdict.usable(a):
            continue
        v = verdict.compare(samples, a.samples, margin=a.margin)
        key = (v.faster, v.speedup or 0.0)
        if best_v is None or key > (best_v.faster, best_v.speedup or 0.0):
            best, best_v = r, v
    band = verdict.noise_band(samples)
    if best is None or best_v is None:
        return None, None, None, band, False, empty
    return (
        best,
        medians[best["run_id"]],
        best_v.speedup,
        best_v.noise_band,
        best_v.faster,
        {"speedup_low": best_v.low, "speedup_high": best_v.high},
    )


def summarize(
    runs: Sequence[Run],
    *,
    milestone: str,
    fingerprint_hash: str,
    bandwidth_bytes_per_s: float | None = None,
    active_experts: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """The ``mxdb.summary`` document of ``runs`` (see the module docstring for the rules).

    ``active_experts`` maps a trace hash to the number of distinct experts its ids use (for
    the memory-bound floor); without it the floor assumes ``min(E, k*M)`` active experts.
    """
    by_group: dict[str, list[Run]] = defaultdict(list)
    for r in runs:
        by_group[group_key(r)].append(r)
    groups = [
        _summarize_group(k, by_group[k], active_experts or {}, bandwidth_bytes_per_s)
        for k in sorted(by_group)
    ]
    version = "1.1" if any(r.get("point") for r in runs) else SCHEMA_VERSION
    extra: dict[str, Any] = {}
    if version != SCHEMA_VERSION:
        for g in groups:
            g.setdefault("speedup_low", None)
            g.setdefault("speedup_high", None)
        extra["false_verify"] = false_verify(runs, by_group)
    speedups = [g["speedup"] for g in groups if _positive(g["speedup"])]
    verified = [g["speedup"] for g in groups if g["verified"] and _positive(g["speedup"])]
    by_status = dict.fromkeys(MEASUREMENT_STATUSES, 0)
    by_role = dict.fromkeys(ROLES, 0)
    for r in runs:
        by_status[r["status"]] = by_status.get(r["status"], 0) + 1
        by_role[r["role"]] = by_role.get(r["role"], 0) + 1
    failures = sorted(
        (
            {"run_id": r["run_id"], "status": r["status"], "error": r.get("error")}
            for r in runs
            if r["status"] in FAILURE_STATUSES
        ),
        key=lambda f: f["run_id"],
    )
    return {
        "schema": "mxdb.summary",
        "schema_version": version,
        "milestone": milestone,
        "fingerprint_hash": fingerprint_hash,
        "bandwidth_bytes_per_s": bandwidth_bytes_per_s,
        "groups": groups,
        "geomean_speedup": stats.geomean(speedups),
        "geomean_verified_speedup": stats.geomean(verified),
        "counts": {
            "runs": len(runs),
            "by_status": by_status,
            "by_role": by_role,
            "groups": len(groups),
            "verified_groups": sum(1 for g in groups if g["verified"]),
            "control_pairs": sum(len(g["control_pairs"]) for g in groups),
        },
        "failures": failures,
        **extra,
    }


def false_verify(runs: Sequence[Run], by_group: Mapping[str, list[Run]]) -> dict[str, Any]:
    """The verdict rule's false-verify rate on this bundle's own A/A comparisons.

    Every comparison of run schema 1.1 times FlagGems' choice three or more times (the
    baseline and its controls); each copy in turn plays a candidate against the others
    (``mxdb.verdict.false_verify_rate``), with the comparison's margin.
    """
    hits = total = 0
    for members in by_group.values():
        if not members[0].get("point"):
            continue
        arms = [pointverdict.arm_from_run(r, None) for r in members]
        _, copies = pointverdict.copies_of(arms)
        if len(copies) < 3:
            continue
        margin = copies[0].margin
        h, t = verdict.false_verify_rate([[list(a.samples) for a in copies]], margin=margin)
        hits += h
        total += t
    return {"comparisons": total, "false_verified": hits, "rate": hits / total if total else None}


def _positive(x: float | None) -> bool:
    return x is not None and x > 0 and x != float("inf")


def load_runs(root: Path) -> list[dict[str, Any]]:
    """The run documents of a bundle directory, as dicts."""
    return [
        load_json(p, what="run file", error=EvidenceError)
        for p in sorted((Path(root) / "runs").glob("*.json"))
    ]


def build_summary(root: Path, *, bandwidth_bytes_per_s: float | None = None) -> dict[str, Any]:
    """Summarize the runs of a bundle directory (standalone; the writer uses ``summarize``)."""
    root = Path(root)
    fp = load_json(root / "fingerprint.json", what="fingerprint", error=EvidenceError)
    active: dict[str, int] = {}
    for p in sorted((root / "traces").glob("*.json")):
        t = load_json(p, what="trace file", error=EvidenceError)
        active[t["trace_hash"]] = len({x for row in t["ids"] for x in row})
    runs = load_runs(root)
    milestone = runs[0]["milestone"] if runs else root.name
    return summarize(
        runs,
        milestone=milestone,
        fingerprint_hash=fp["hash"],
        bandwidth_bytes_per_s=bandwidth_bytes_per_s,
        active_experts=active,
    )
