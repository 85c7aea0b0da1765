"""The tuning-cost claim of a bundle (``tuning_cost.json``): its figures from the raw files.

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
  the ``exhaustive_gemm1``/``exhaustive_gemm2`` runs time exactly those configs;
- (schema 1.2) ``perf_model``: the learned performance model that ordered and pruned mxdb's
  first rung (``benchmarks/bench_tuning.py --model``): the path it was given, the SHA-256 of
  its ``model.json``, a byte-identical copy in the bundle (``file``), and the shape families it
  was trained on (as the copy states them); each point's ``held_out_family`` says its family
  is not among them, and the point meets the target only on a held-out family and at no more
  than :data:`TARGET_GPU_FRACTION_MODEL` of the exhaustive GPU time.

This module writes the document (:func:`build_tuning_cost`); :mod:`mxdb.audit.tuning_cost`
declares it as a kind of evidence, and the audit recomputes every figure with the same
functions.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from mxdb.configs import config_hash
from mxdb.evidence import stats
from mxdb.shapes import MoEShape

TUNING_COST_NAME = "tuning_cost.json"
SCHEMA = "mxdb.tuning-cost"
SCHEMA_VERSION = "1.2"
#: Versions this module reads: 1.0 (the mxdb run's ratio), 1.1 (mxdb's answer's ratio), 1.2
#: (1.1 with the performance model that ordered the search).
SCHEMA_VERSIONS = ("1.0", "1.1", "1.2")
TARGET_QUALITY = 1.01
TARGET_GPU_FRACTION = 0.10
#: The GPU-time target of a search ordered by a performance model (schema 1.2).
TARGET_GPU_FRACTION_MODEL = 0.05
#: Where a 1.2 bundle holds its copy of the model file.
PERF_MODEL_FILE = "perf_model/model.json"
EXHAUSTIVE_LABELS = ("exhaustive_gemm1", "exhaustive_gemm2", "exhaustive_combined")


def _samples(run: Mapping[str, Any] | None) -> list[float]:
    if not run or run.get("status") != "ok":
        return []
    timing = run.get("timing") or {}
    return [float(x) for x in timing.get("samples_us") or []]


def _med(run: Mapping[str, Any] | None) -> float | None:
    s = _samples(run)
    return stats.median(s) if s else None


def sweep_best(doc: Mapping[str, Any]) -> tuple[str | None, int]:
    rows = [r for r in doc.get("timed", []) if r.get("status") == "ok" and r.get("samples_us")]
    if not rows:
        return None, 0
    best = min(rows, key=lambda r: stats.median([float(x) for x in r["samples_us"]]))
    return config_hash(best["config"]), len(rows)


def model_names(doc: Mapping[str, Any]) -> dict[str, list[str] | None]:
    """What a performance model's document says of its training families by name: the
    families it was trained on (``families``, or ``training.families``) and those left out
    (``excluded``), each sorted, None where the document does not say."""

    def names(v: Any) -> list[str] | None:
        return sorted(str(f) for f in v) if isinstance(v, list) else None

    training = doc.get("training")
    trained = doc.get("families")
    if trained is None and isinstance(training, Mapping):
        trained = training.get("families")
    return {"families": names(trained), "excluded": names(doc.get("excluded"))}


def point_family(point: Mapping[str, Any]) -> str:
    """The shape family (``MoEShape.family``) of a point."""
    return MoEShape.from_dict(point["shape"]).family


def recompute_point(
    point: Mapping[str, Any],
    runs: Mapping[str, Mapping[str, Any]],
    model_families: Collection[str] | None = None,
) -> dict[str, Any]:
    """The figures of one point, from its runs' raw samples and its listed call times;
    ``model_families``: the shape families of the model that ordered the search (schema 1.2)."""
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
    if model_families is None:
        out["meets_target"] = bool(
            q is not None and f is not None and q <= TARGET_QUALITY and f <= TARGET_GPU_FRACTION
        )
        return out
    held_out = point_family(point) not in set(model_families)
    out["held_out_family"] = held_out
    out["meets_target"] = bool(
        held_out
        and q is not None
        and f is not None
        and q <= TARGET_QUALITY
        and f <= TARGET_GPU_FRACTION_MODEL
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
    perf_model: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``tuning_cost.json`` document for ``points`` (figures computed here);
    ``perf_model``: the record of the model that ordered the search (schema 1.2)."""
    families = list(perf_model["shape_families"]) if perf_model is not None else None
    out_points = []
    for p in points:
        fig = recompute_point(p, runs, families)
        n = sum(sweep_best(sweeps[rel])[1] for rel in p["exhaustive"]["sweeps"])
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
    if perf_model is None:
        version = "1.1" if versioned else "1.0"
        target = f"quality_ratio <= {TARGET_QUALITY} and gpu_time_fraction <= {TARGET_GPU_FRACTION}"
    else:
        version = SCHEMA_VERSION
        target = (
            f"quality_ratio <= {TARGET_QUALITY} and gpu_time_fraction <= "
            f"{TARGET_GPU_FRACTION_MODEL}, on a point whose shape family the model that ordered "
            "the search was not trained on (held_out_family)"
        )
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "schema_version": version,
        "definitions": {**definitions, "quality_ratio": quality_def, "target": target},
    }
    if perf_model is not None:
        doc["perf_model"] = dict(perf_model)
        doc["definitions"]["perf_model"] = (
            "the performance model that ordered and pruned mxdb's first rung: path = the file "
            "the run was given, sha256 = SHA-256 of that model.json, file = its byte-identical "
            "copy in this bundle, shape_families = the shape families (E-H-I-k) it was trained "
            "on, families and excluded = the model families it names as trained on and as left "
            "out, all as the copy states them; held_out_family = the point's shape family is "
            "not among shape_families"
        )
    doc["points"] = out_points
    doc["summary"] = summarise(out_points)
    return doc


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
