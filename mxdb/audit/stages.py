"""The stage profile (``stages.json``) as a kind of evidence: its declaration for the claims engine.

Per point: every sample a finite positive number (``align`` may be empty: the pipeline skips
alignment at small M), the shape that of the family at M, the config hash that of the config;
the touched experts recomputed by regenerating the routing.  Every derived field and figure is
recomputed with :mod:`mxdb.evidence.stages`' own functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mxdb.audit.claims import (
    DECODE_SETTING,
    ClaimKind,
    Context,
    Path_,
    Unit,
    check_samples,
    check_shape_and_config,
)
from mxdb.audit.findings import FindingSink
from mxdb.evidence.stages import (
    IMPL_STAGES,
    LARGE_MIN_TOKENS,
    REPORT_FILE,
    bandwidth_figures,
    build_figures,
    impl_of,
    point_figures,
    render,
    stages_of,
)


def _code(path: Path_) -> str:
    if path[:1] == ("points",) and len(path) >= 3:
        return "median_mismatch" if path[2] == "median_us" else "figure_mismatch"
    if path[:1] == ("bandwidth",):
        return "bandwidth_mismatch"
    return "geomean_mismatch" if path[:1] == ("figures",) else "field_mismatch"


def _point_ok(sink: FindingSink, rel: str, where: str, p: Mapping[str, Any], ctx: Context) -> bool:
    ok = True
    version = str(ctx.doc["schema_version"])
    impl = impl_of(p["config"])
    if version != "1.0" and p.get("impl") != impl:
        sink.add("stages.field_mismatch", rel, f"{where}.impl", impl, p.get("impl"),
                 "the point's implementation is its config's")  # fmt: skip
        ok = False
    timed = (*IMPL_STAGES.get(impl, ()), "layer")
    for name in (*stages_of(version), "layer"):
        has = bool(p["samples"].get(name))
        if name in timed and not has:  # align may be empty: the pipeline may skip alignment
            sink.add("stages.sample_invalid", rel, f"{where}.samples.{name}",
                     "at least one sample", p["samples"].get(name), "a stage without samples")  # fmt: skip
            ok = False
        elif name not in timed and name != "align" and has:
            sink.add("stages.sample_invalid", rel, f"{where}.samples.{name}", "no samples",
                     len(p["samples"][name]), f"{impl} has no {name} stage")  # fmt: skip
            ok = False
    ok &= check_samples(sink, rel, f"{where}.samples", "stages", p["samples"])
    check_shape_and_config(sink, rel, where, "stages", p)
    return ok


def _preflight(sink: FindingSink, rel: str, doc: Mapping[str, Any], _: Context) -> bool:
    bw = doc["bandwidth"]
    return check_samples(sink, rel, "bandwidth", "stages", {
        k: bw[k] for k in ("copy_samples", "read_samples", "matmul_samples")
    }, "a finite positive rate (bytes or FLOP per second)")  # fmt: skip


def _point(p: Mapping[str, Any], ctx: Context) -> Mapping[str, Any]:
    return point_figures(p, ctx.doc["bandwidth"], str(ctx.doc["schema_version"]))


def _figures(doc: Mapping[str, Any], _: Context) -> Mapping[str, Any]:
    b = doc["bandwidth"]
    bw = bandwidth_figures(b["copy_samples"], b["read_samples"], b["matmul_samples"])
    # the groups' figures from the points' recomputed figures, not their claimed ones
    version = str(doc["schema_version"])
    points = [{**p, **point_figures(p, bw, version)} for p in doc["points"]]
    return {
        "bandwidth": bw,
        "figures": build_figures(points, doc["decode_max_tokens"], doc["large_min_tokens"]),
    }


KIND = ClaimKind(
    name="stages",
    document="stages.json",
    schema="mxdb.stages",
    codes=_code,
    units=(Unit("points", check=_point_ok, figures=_point),),
    figures=_figures,
    preflight=_preflight,
    report=(REPORT_FILE, render),
    settings={
        **DECODE_SETTING,
        "large_min_tokens": (LARGE_MIN_TOKENS, "large points are those with M at least 64"),
    },
)
