"""The tuning-cost claim of a bundle (``tuning_cost.json``): recomputed from its raw files.

A tuning-cost bundle compares, per point, mxdb's search with an exhaustive search of the
same grid.  Its ``tuning_cost.json`` claims, for each point:

- ``exhaustive_best``: the fastest of the bundle's ``exhaustive_*`` runs (median of the raw
  samples of one final interleaved timing), and ``quality_ratio`` = median(mxdb run) /
  median(exhaustive best run);
- ``dispatched``: what a dispatcher would serve: mxdb's winner when its speedup over the
  baseline run exceeds the noise band of the baseline/control pair, else the baseline; and
  ``dispatched_quality_ratio`` likewise;
- ``gpu_seconds`` of each side = the sum of its listed ``time_call_wall_s``, and
  ``gpu_time_fraction`` = mxdb's / the exhaustive search's;
- ``meets_target``: quality ratio <= 1.01 and GPU-time fraction <= 0.10;
- (schema 1.1) ``answer``: what mxdb itself would dispatch after its own search, recomputed
  from the samples of its final comparison (``mxdb.comparison``): its winner when the winner's
  speedup over FlagGems' choice exceeds the noise band of the control pair, else FlagGems'
  choice.  ``quality_ratio`` is then median(answer's run) / median(exhaustive best run), the
  answer's run being the ``mxdb`` run (winner) or the ``baseline`` run (FlagGems' choice), and
  ``winner_quality_ratio`` is the winner's own ratio whichever is dispatched;
- each sweep file's ``best`` is the config with the smallest median among its timed rows, and
  the ``exhaustive_gemm1``/``exhaustive_gemm2`` runs time exactly those configs.

This module writes the document (:func:`build_tuning_cost`) and declares it as a kind of
evidence (``KIND``): the audit recomputes every figure with the same functions; a mismatch is
a finding.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from mxdb.audit.claims import ClaimKind, Context, Unit
from mxdb.audit.findings import FindingSink
from mxdb.configs import config_hash
from mxdb.errors import InvalidInputError
from mxdb.evidence import stats
from mxdb.fileio import parse_json

TUNING_COST_NAME = "tuning_cost.json"
SCHEMA = "mxdb.tuning-cost"
SCHEMA_VERSION = "1.1"
#: Versions this module reads: 1.0 (the mxdb run's ratio), 1.1 (mxdb's answer's ratio).
SCHEMA_VERSIONS = ("1.0", "1.1")
TARGET_QUALITY = 1.01
TARGET_GPU_FRACTION = 0.10
EXHAUSTIVE_LABELS = ("exhaustive_gemm1", "exhaustive_gemm2", "exhaustive_combined")


def _samples(run: Mapping[str, Any] | None) -> list[float]:
    if not run or run.get("status") != "ok":
        return []
    timing = run.get("timing") or {}
    return [float(x) for x in timing.get("samples_us") or []]


def _med(run: Mapping[str, Any] | None) -> float | None:
    s = _samples(run)
    return stats.median(s) if s else None


def _sweep_best(doc: Mapping[str, Any]) -> tuple[str | None, int]:
    rows = [r for r in doc.get("timed", []) if r.get("status") == "ok" and r.get("samples_us")]
    if not rows:
        return None, 0
    best = min(rows, key=lambda r: stats.median([float(x) for x in r["samples_us"]]))
    return config_hash(best["config"]), len(rows)


def recompute_point(
    point: Mapping[str, Any], runs: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any]:
    """The figures of one point, from its runs' raw samples and its listed call times."""
    ids = point["runs"]
    meds = {label: _med(runs.get(ids.get(label, ""))) for label in EXHAUSTIVE_LABELS}
    timed = {k: v for k, v in meds.items() if v is not None}
    best = min(timed, key=lambda k: (timed[k], k)) if timed else None
    mx = _med(runs.get(ids.get("mxdb", "")))
    base = _med(runs.get(ids.get("baseline", "")))
    ctl = _med(runs.get(ids.get("control", "")))
    ex_s = float(sum(point["exhaustive"]["time_call_wall_s"]))
    mx_s = float(sum(point["mxdb"]["time_call_wall_s"]))
    quality = mx / timed[best] if (best and mx) else None
    out: dict[str, Any] = {
        "exhaustive_best": best,
        "exhaustive_best_median_us": timed.get(best) if best else None,
        "mxdb_median_us": mx,
        "baseline_median_us": base,
        "quality_ratio": quality,
        "exhaustive_gpu_seconds": ex_s,
        "mxdb_gpu_seconds": mx_s,
        "gpu_time_fraction": mx_s / ex_s if ex_s > 0 else None,
    }
    dispatched = "baseline"
    if (
        mx is not None
        and base is not None
        and ctl is not None
        and stats.speedup(base, mx) - 1.0 > stats.pair_noise(base, ctl)
    ):
        dispatched = "mxdb"
    out["dispatched"] = dispatched
    d_med = mx if dispatched == "mxdb" else base
    out["dispatched_quality_ratio"] = d_med / timed[best] if (best and d_med) else None
    comparison = point["mxdb"].get("comparison")
    if comparison is not None:
        out["answer"] = mxdb_answer(comparison)
        out["winner_quality_ratio"] = quality
        a_med = mx if out["answer"] == "winner" else base
        out["quality_ratio"] = a_med / timed[best] if (best and a_med) else None
    q, f = out["quality_ratio"], out["gpu_time_fraction"]
    out["meets_target"] = bool(
        q is not None and f is not None and q <= TARGET_QUALITY and f <= TARGET_GPU_FRACTION
    )
    return out


def mxdb_answer(comparison: Mapping[str, Any]) -> str:
    """ "winner" or "baseline": mxdb's dispatch rule on the samples of its own final comparison."""
    win = [float(x) for x in comparison.get("winner_samples_us") or []]
    base = [float(x) for x in comparison.get("baseline_samples_us") or []]
    ctl = comparison.get("control_samples_us") or [[], []]
    a, b = ([float(x) for x in c] for c in ctl)
    if not (comparison.get("winner_config_hash") and win and base and a and b):
        return "baseline"
    band = stats.pair_noise(stats.median(a), stats.median(b))
    speedup = stats.speedup(stats.median(base), stats.median(win))
    return "winner" if speedup - 1.0 > band else "baseline"


def build_tuning_cost(
    points: list[dict[str, Any]],
    runs: Mapping[str, Mapping[str, Any]],
    sweeps: Mapping[str, Mapping[str, Any]],
    *,
    definitions: Mapping[str, str],
) -> dict[str, Any]:
    """The ``tuning_cost.json`` document for ``points`` (figures computed here)."""
    out_points = []
    for p in points:
        fig = recompute_point(p, runs)
        n = sum(_sweep_best(sweeps[rel])[1] for rel in p["exhaustive"]["sweeps"])
        out_points.append({**p, **fig, "exhaustive_configs_timed": n})
    versioned = any("comparison" in p["mxdb"] for p in points)
    quality_def = (
        "median(answer run samples) / median(exhaustive best run samples), both from one final "
        "interleaved CUDA-graph timing; the answer is what mxdb dispatches after its search: "
        "its winner if, in the search's own final comparison (mxdb.comparison), the winner "
        "beats FlagGems' choice by more than the control pair's noise band, else FlagGems' "
        "choice (the baseline run); winner_quality_ratio is the winner's ratio either way"
        if versioned
        else "median(mxdb run samples) / median(exhaustive best run samples), both from one "
        "final interleaved CUDA-graph timing"
    )
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION if versioned else "1.0",
        "definitions": {
            **definitions,
            "quality_ratio": quality_def,
            "target": f"quality_ratio <= {TARGET_QUALITY} and gpu_time_fraction <= "
            f"{TARGET_GPU_FRACTION}",
        },
        "points": out_points,
        "summary": summarise(out_points),
    }


def summarise(points: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The document's summary of its points."""
    qs: list[float] = [p["quality_ratio"] for p in points if p.get("quality_ratio")]
    fs: list[float] = [
        p["gpu_time_fraction"] for p in points if p.get("gpu_time_fraction") is not None
    ]
    return {
        "points": len(points),
        "meeting_target": sum(1 for p in points if p.get("meets_target")),
        "geomean_quality_ratio": stats.geomean(qs) if qs else None,
        "max_gpu_time_fraction": max(fs) if fs else None,
    }


def _preflight(sink: FindingSink, rel: str, doc: Mapping[str, Any], _: Context) -> bool:
    # no JSON Schema describes this document: its type, version and points are checked here
    if doc.get("schema") != SCHEMA or doc.get("schema_version") not in SCHEMA_VERSIONS:
        sink.add(
            "tuning_cost.schema",
            rel,
            "schema",
            f"{SCHEMA} {SCHEMA_VERSION}",
            f"{doc.get('schema')} {doc.get('schema_version')}",
            "not a tuning-cost document this mxdb understands",
        )
        return False
    points = doc.get("points")
    if not isinstance(points, list) or not points:
        sink.add("tuning_cost.invalid", rel, "points", "a list of points", points, "no points")
        return False
    return True


def _point_ok(sink: FindingSink, rel: str, where: str, p: Mapping[str, Any], ctx: Context) -> bool:
    """The point's runs and sweep files are the bundle's, and its figures can be recomputed."""
    try:
        ids, runs, contents = p["runs"], ctx.runs, ctx.contents
        missing = [lbl for lbl, rid in ids.items() if rid not in runs]
        if missing:
            sink.add(
                "tuning_cost.missing_run",
                rel,
                f"{where}.runs",
                "runs present in runs/",
                missing,
                "the claim names runs the bundle does not hold",
            )
            return False
        if ctx.doc.get("schema_version") != "1.0" and "comparison" not in p["mxdb"]:
            sink.add(
                "tuning_cost.invalid",
                rel,
                f"{where}.mxdb.comparison",
                "mxdb's final comparison",
                None,
                "a 1.1 claim must carry the samples that decide mxdb's answer",
            )
            return False
        recompute_point(p, runs)  # raises on a malformed point, before its figures are compared
        recorded = p["exhaustive"].get("recorded_in")
        if recorded is not None:
            # reused sweeps: the bundle's copies must be the files the run recorded
            found = [
                hashlib.sha256(contents[s]).hexdigest() if s in contents else None
                for s in p["exhaustive"]["sweeps"]
            ]
            if found != list(recorded.get("sweep_sha256") or []):
                sink.add(
                    "tuning_cost.sweep_source",
                    rel,
                    f"{where}.exhaustive.recorded_in.sweep_sha256",
                    found,
                    recorded.get("sweep_sha256"),
                    "the sweep files differ from the recorded run's",
                )
        for sweep_rel, label in zip(
            p["exhaustive"]["sweeps"], ("exhaustive_gemm1", "exhaustive_gemm2"), strict=True
        ):
            if sweep_rel not in contents:
                sink.add(
                    "tuning_cost.missing_sweep",
                    rel,
                    f"{where}.exhaustive.sweeps",
                    sweep_rel,
                    "no file",
                    "the claim names a sweep file the bundle does not hold",
                )
                continue
            sweep = parse_json(contents[sweep_rel], what=sweep_rel)
            best_hash, _ = _sweep_best(sweep)
            run_hash = runs[ids[label]].get("config_hash")
            if best_hash != config_hash(sweep.get("best", {})) or best_hash != run_hash:
                sink.add(
                    "tuning_cost.sweep_best",
                    sweep_rel,
                    "best",
                    best_hash,
                    run_hash,
                    f"the {label} run does not time the sweep's fastest config",
                )
        return True
    except (AttributeError, KeyError, TypeError, ValueError, InvalidInputError) as exc:
        sink.add("tuning_cost.invalid", rel, where, "a complete point", repr(exc)[:80], "malformed")
        return False


def _point_figures(p: Mapping[str, Any], ctx: Context) -> Mapping[str, Any]:
    sweeps = [s for s in p["exhaustive"]["sweeps"] if s in ctx.contents]
    n = sum(_sweep_best(parse_json(ctx.contents[s], what=s))[1] for s in sweeps)
    return {**recompute_point(p, ctx.runs), "exhaustive_configs_timed": n}


def _figures(doc: Mapping[str, Any], ctx: Context) -> Mapping[str, Any]:
    # the summary of the recomputed points (each point's claimed figures are compared above)
    return {"summary": summarise([recompute_point(p, ctx.runs) for p in doc["points"]])}


KIND = ClaimKind(
    name="tuning_cost",
    document=TUNING_COST_NAME,
    schema=None,
    codes=lambda _: "mismatch",
    units=(Unit("points", check=_point_ok, figures=_point_figures),),
    figures=_figures,
    preflight=_preflight,
    fingerprint_field=None,
)
