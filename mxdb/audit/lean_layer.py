"""The audit of a lean-layer claim (``lean_layer.json``): every figure from its raw samples.

Per point: every sample a finite positive number, the shape that of the family at M, the
config hash that of the config, the correctness verdict that of the errors against the dtype's
thresholds.  Then every figure is recomputed with
:func:`mxdb.evidence.lean_layer.build_lean_layer` (the writer's own function) from the point's
samples and compared leaf by leaf within the audit's tolerance, and each target's threshold,
measured value and verdict are checked (a "pass" for a missed target is a finding).
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
from mxdb.evidence.lean_layer import (
    REPORT_FILE,
    SERIES,
    TARGETS,
    build_lean_layer,
    render,
)
from mxdb.evidence.thresholds import THRESHOLDS, passes

_POINT_CODES: dict[str, str] = {
    "median_us": "median_mismatch",
    "p90_us": "median_mismatch",
    "eager_over_graph_layer": "ratio_mismatch",
    "eager_over_graph_layer_graphs": "ratio_mismatch",
    "synced_over_graph_layer": "ratio_mismatch",
    "eager_speedup_layer_over_fused_experts_impl": "ratio_mismatch",
    "synced_speedup_layer_over_fused_experts_impl": "ratio_mismatch",
    "host_speedup_layer_over_fused_experts_impl": "ratio_mismatch",
}


def _code(path: Path_) -> str:
    if path[:1] == ("points",) and len(path) >= 3:
        return "lean_layer." + _POINT_CODES.get(str(path[2]), "field_mismatch")
    if path[:1] == ("figures",) and len(path) >= 2:
        key = str(path[1])
        return "lean_layer." + ("count_mismatch" if key.startswith("n_") else "geomean_mismatch")
    return "lean_layer.field_mismatch"


def _point_ok(sink: FindingSink, rel: str, where: str, p: Mapping[str, Any], _: Context) -> bool:
    ok = check_samples(
        sink, rel, f"{where}.samples", "lean_layer", {n: p["samples"][n] for n in SERIES}
    )
    ok &= check_samples(sink, rel, f"{where}.host_us", "lean_layer", p["host_us"])
    check_shape_and_config(sink, rel, where, "lean_layer", p)
    c = p["correctness"]
    dtype = p["shape"]["dtype"]
    t = THRESHOLDS.get(dtype)
    if t is not None:
        want_c = {
            "threshold_abs": t.max_abs,
            "threshold_rel": t.max_rel,
            "passed": passes(dtype, c["max_abs_err"], c["rel_err"]),
        }
        for key, exp in want_c.items():
            if c[key] != exp:
                sink.add(
                    "lean_layer.correctness_mismatch",
                    rel,
                    f"{where}.correctness.{key}",
                    exp,
                    c[key],
                    "correctness is not the verdict of its errors against the dtype's table",
                )
    return ok


def _figures(doc: Mapping[str, Any], _: Context) -> Mapping[str, Any]:
    return build_lean_layer(
        doc["points"],
        milestone=doc["milestone"],
        fingerprint_hash=doc["fingerprint_hash"],
        decode_max_tokens=doc["decode_max_tokens"],
        profile=doc["profile"],
        errors=doc["errors"],
    )


KIND = ClaimKind(
    name="lean_layer",
    document="lean_layer.json",
    schema="mxdb.lean-layer",
    codes=_code,
    units=(Unit("points", check=_point_ok),),
    figures=_figures,
    targets=TARGETS,
    whole_document=True,
    report=(REPORT_FILE, render),
    settings=DECODE_SETTING,
)
