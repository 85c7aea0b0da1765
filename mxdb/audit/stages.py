"""The stage profile (``stages.json``) as a kind of evidence: its declaration for the claims engine.

Per point: every sample a finite positive number (``align`` may be empty: the pipeline skips
alignment at small M), the shape that of the family at M, the config hash that of the config;
the touched experts recomputed by regenerating the routing.  Every derived field and figure is
recomputed with :mod:`mxdb.evidence.stages`' own functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mxdb.audit.claims import ClaimKind, Context, Path_, Unit
from mxdb.audit.findings import FindingSink
from mxdb.configs import config_hash
from mxdb.evidence import stats
from mxdb.evidence.stages import (
    DECODE_MAX_TOKENS,
    LARGE_MIN_TOKENS,
    SERIES,
    bandwidth_figures,
    build_figures,
    point_figures,
)
from mxdb.shapes import preset_shape


def _code(path: Path_) -> str:
    if path[:1] == ("points",) and len(path) >= 3:
        return "median_mismatch" if path[2] == "median_us" else "figure_mismatch"
    if path[:1] == ("bandwidth",):
        return "bandwidth_mismatch"
    return "geomean_mismatch" if path[:1] == ("figures",) else "field_mismatch"


def _point_ok(sink: FindingSink, rel: str, where: str, p: Mapping[str, Any], _: Context) -> bool:
    ok = True
    for name in SERIES:
        samples = p["samples"].get(name)
        if samples is None or (not samples and name != "align"):
            sink.add("stages.sample_invalid", rel, f"{where}.samples.{name}",
                     "at least one sample", samples, "a stage without samples")  # fmt: skip
            ok = False
            continue
        bad = [j for j, x in enumerate(samples) if not stats.valid_sample(x)]
        if bad:
            sink.add("stages.sample_invalid", rel, f"{where}.samples.{name}[{bad[0]}]",
                     "a finite positive number of microseconds", samples[bad[0]],
                     f"{len(bad)} invalid timing sample(s)")  # fmt: skip
            ok = False
    try:
        want = preset_shape(p["family"], p["tokens"], p["shape"]["dtype"]).to_dict()
    except Exception:  # an unknown family or dtype: no shape can match
        want = {"family": p["family"], "tokens": p["tokens"]}
    if want != p["shape"]:
        sink.add("stages.shape_mismatch", rel, f"{where}.shape", want, p["shape"],
                 "the shape is not that of the family at this token count")  # fmt: skip
        ok = False
    try:
        h = config_hash(p["config"])
    except Exception as exc:  # a config that cannot be hashed is a finding, not a crash
        h = f"no hash ({type(exc).__name__})"
    if h != p["config_hash"]:
        sink.add("stages.config_hash_mismatch", rel, f"{where}.config_hash", h,
                 p["config_hash"], "config_hash is not the hash of the config")  # fmt: skip
    return ok


def _preflight(sink: FindingSink, rel: str, doc: Mapping[str, Any], _: Context) -> bool:
    bw = doc["bandwidth"]
    for key in ("copy_samples", "read_samples", "matmul_samples"):
        if not all(stats.valid_sample(x) for x in bw[key]):
            sink.add("stages.sample_invalid", rel, f"bandwidth.{key}",
                     "finite positive bytes per second", bw[key], "invalid bandwidth sample")  # fmt: skip
            return False
    for key, want in (("decode_max_tokens", DECODE_MAX_TOKENS),
                      ("large_min_tokens", LARGE_MIN_TOKENS)):  # fmt: skip
        if doc[key] != want:
            sink.add("stages.field_mismatch", rel, key, want, doc[key],
                     "the size groups are mxdb's")  # fmt: skip
    return True


def _point(p: Mapping[str, Any], ctx: Context) -> Mapping[str, Any]:
    return point_figures(p, ctx.doc["bandwidth"])


def _figures(doc: Mapping[str, Any], _: Context) -> Mapping[str, Any]:
    b = doc["bandwidth"]
    bw = bandwidth_figures(b["copy_samples"], b["read_samples"], b["matmul_samples"])
    # the groups' figures from the points' recomputed figures, not their claimed ones
    points = [{**p, **point_figures(p, bw)} for p in doc["points"]]
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
)
