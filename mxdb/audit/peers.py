"""The peers claim (``peers.json``) as a kind of evidence: every figure from the runs' samples.

Each point's runs must be in the bundle with the role of their label, the point's token count
and trace, and the control pair must time config (c) (config (a) under ``rule: "verdict"``,
where the pair are copies of FlagGems' choice).  The figures are then recomputed with
:func:`mxdb.evidence.peers.build_peers` (the writer's own function, on the runs' raw samples)
and compared leaf by leaf within the audit's tolerance by :func:`mxdb.audit.claims.audit_claim`,
which judges the targets too (a "pass" for a missed target is a finding).  A document with ``explanations``
has them and its points' extended figures recomputed the same way (hot shares from the
bundle's traces), and a point whose recorded dispatch reason is a fallback must have run
FlagGems' config as (c).  A document of schema 1.2 is checked per instance (each instance's
runs against its own trace, the same run checks), each instance's ``routing_class`` is
recomputed from its trace (``mxdb.routing.classify``), and the pooled figures, per-instance
verdicts and instance counts are recomputed by the same ``build_peers``.  A document of schema
1.4 has its streaming-read floor fraction recomputed from its recorded read bandwidth.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mxdb.audit.claims import DECODE_SETTING, ClaimKind, Context, Path_, Unit
from mxdb.audit.findings import FindingSink
from mxdb.evidence.peers import (
    ENTRY_REASONS,
    INCUMBENT_VERSIONS,
    LABELS,
    REPORT_FILE,
    ROLES,
    build_peers,
    render,
    targets_for,
    trace_class,
    trace_figures,
)
from mxdb.shapes import family_shape

_POINT_CODES: dict[str, str] = {
    "median_us": "median_mismatch",
    "eager_median_us": "median_mismatch",
    "noise_band": "noise_band_mismatch",
    "floor_us": "floor_mismatch",
    "active_experts": "floor_mismatch",
    "floor_fraction_a": "ratio_mismatch",
    "floor_fraction_b": "ratio_mismatch",
    "floor_fraction_c": "ratio_mismatch",
    "speedup_c_over_a": "ratio_mismatch",
    "speedup_c_over_b": "ratio_mismatch",
    "speedup_c_over_d": "ratio_mismatch",
    "eager_speedup_layer_over_fused_experts_impl": "ratio_mismatch",
    "eager_over_graph_layer": "ratio_mismatch",
    "winner": "flag_mismatch",
    "c_differs_from_d": "flag_mismatch",
    "c_slower_than_a": "flag_mismatch",
    "c_slower_than_b": "flag_mismatch",
    "floor_fraction_best": "ratio_mismatch",
    "speedup_best_over_a": "ratio_mismatch",
    "speedup_best_over_b": "ratio_mismatch",
    "floor_bound_over_a": "ratio_mismatch",
    "uniform_floor_fraction_best": "ratio_mismatch",
    "skew_cost": "ratio_mismatch",
    "c_config_is_a": "flag_mismatch",
    "c_config_is_b": "flag_mismatch",
    "c_faster_than_a": "flag_mismatch",
    "c_faster_than_b": "flag_mismatch",
    "d_faster_than_c": "flag_mismatch",
    "outcome_c_vs_a": "flag_mismatch",
    "outcome_c_vs_b": "flag_mismatch",
}


def _code(path: Path_) -> str:
    if path[:1] == ("points",) and len(path) >= 5 and path[2] == "instances":
        return "peers." + _POINT_CODES.get(str(path[4]), "field_mismatch")
    if path[:1] == ("points",) and len(path) >= 3:
        return "peers." + _POINT_CODES.get(str(path[2]), "field_mismatch")
    if path[:1] == ("figures",) and len(path) >= 2:
        key = str(path[1])
        return "peers." + ("geomean_mismatch" if "geomean" in key else "count_mismatch")
    if path[:1] == ("explanations",) and len(path) >= 2:
        keys = [str(k) for k in path[1:] if not isinstance(k, int)]
        if any("geomean" in k for k in keys):
            return "peers.geomean_mismatch"
        if any(k.startswith("points_") or k.endswith("_by_dispatch_reason") for k in keys):
            return "peers.count_mismatch"
        if keys and keys[-1] in _POINT_CODES:
            return "peers." + _POINT_CODES[keys[-1]]
    return "peers.field_mismatch"


def _point_ok(sink: FindingSink, rel: str, where: str, p: Mapping[str, Any], ctx: Context) -> bool:
    """False (with its findings) for a point whose runs cannot support it.

    A point with ``instances`` (schema 1.2) is checked instance by instance: each instance's
    runs against its own trace, its indices ``0..K-1`` in order, and the point itself names
    no runs or trace.
    """
    instances = p.get("instances")
    if instances is None:
        if p.get("runs") is None or p.get("trace_hash") is None:
            sink.add(
                "peers.run_missing",
                rel,
                f"{where}.runs",
                "run ids and a trace (or instances, schema 1.2)",
                "null",
                "a point names neither runs nor instances",
            )
            return False
        return not _runs_problems(sink, rel, where, p, ctx)
    bad = False
    if not instances:
        sink.add(
            "peers.run_missing",
            rel,
            f"{where}.instances",
            "at least one instance",
            "none",
            "a point of schema 1.2 without instances",
        )
        bad = True
    for key in ("runs", "trace_hash"):
        if p.get(key) is not None:
            sink.add(
                "peers.field_mismatch",
                rel,
                f"{where}.{key}",
                None,
                p.get(key),
                "a point with instances names its runs and traces per instance only",
            )
            bad = True
    for j, inst in enumerate(instances):
        at = f"{where}.instances[{j}]"
        if inst.get("instance") != j:
            sink.add(
                "peers.field_mismatch",
                rel,
                f"{at}.instance",
                j,
                inst.get("instance"),
                "instances are listed by index, 0 to K-1",
            )
            bad = True
        full = {**inst, "family": p["family"], "tokens": p["tokens"]}
        bad |= _runs_problems(sink, rel, at, full, ctx)
    return not bad


def _runs_problems(
    sink: FindingSink,
    rel: str,
    where: str,
    p: Mapping[str, Any],
    ctx: Context,
) -> bool:
    """The run checks of one interleaved comparison (a point, or an instance of one); True
    when it has a problem."""
    runs, ids = ctx.runs, p["runs"]
    # under ``rule: "verdict"`` the control pair are copies of FlagGems' choice (a), else of (c)
    copies_of = "a" if ctx.doc.get("rule") == "verdict" else "c"
    bad = False
    for lab in LABELS:
        rid = ids.get(lab)
        if rid is None:
            continue
        run = runs.get(rid)
        timing = (run or {}).get("timing") or {}
        if run is None or not timing.get("samples_us"):
            sink.add(
                "peers.run_missing",
                rel,
                f"{where}.runs.{lab}",
                f"run {rid} with timing samples",
                "absent" if run is None else f"status {run.get('status')}, no samples",
                "a point names a run the bundle does not hold (or one without samples)",
            )
            bad = True
            continue
        problems: list[tuple[str, Any, Any]] = []
        if run["role"] != ROLES[lab]:
            problems.append(("role", ROLES[lab], run["role"]))
        if run["shape"]["tokens"] != p["tokens"]:
            problems.append(("shape.tokens", p["tokens"], run["shape"]["tokens"]))
        if run.get("trace_hash") != p["trace_hash"]:
            problems.append(("trace_hash", p["trace_hash"], run.get("trace_hash")))
        try:
            want = family_shape(p["family"], p["tokens"], run["shape"]["dtype"]).to_dict()
        except Exception:  # an unknown family: the shape cannot match
            want = {"family": p["family"]}
        if want != run["shape"]:
            problems.append(("shape", want, run["shape"]))
        if lab.startswith("ctl") and run["config_hash"] != runs.get(ids[copies_of], {}).get(
            "config_hash"
        ):
            problems.append(("config_hash", f"config ({copies_of})'s hash", run["config_hash"]))
        for fld, exp, got in problems:
            sink.add(
                "peers.run_mismatch",
                rel,
                f"{where}.runs.{lab}",
                f"{fld} {exp}",
                f"{fld} {got} in run {rid}",
                f"run {rid} does not measure this point as label ({lab})",
            )
            bad = True
    reason = p.get("dispatch_reason_c")
    if reason is not None and reason not in (*ENTRY_REASONS, "predicted"):
        # a fallback runs FlagGems' choice (a); against the incumbent (schema 1.5) it runs the
        # incumbent's row (b) where the device has a table, which is (b) by construction
        allowed = ("a", "b") if ctx.doc.get("schema_version") in INCUMBENT_VERSIONS else ("a",)
        c_hash = (runs.get(ids["c"]) or {}).get("config_hash")
        if all(c_hash != (runs.get(ids[x]) or {}).get("config_hash") for x in allowed):
            sink.add(
                "peers.run_mismatch",
                rel,
                f"{where}.runs.c",
                f"config ({' or '.join(allowed)})'s hash: the dispatcher fell back to FlagGems' "
                "choice or the incumbent's row",
                f"config_hash {c_hash} in run {ids['c']}",
                f"the point records the fallback reason {reason!r}, but (c) ran another config",
            )
            bad = True
    if p["trace_hash"] not in ctx.traces:
        sink.add(
            "peers.run_missing",
            rel,
            f"{where}.trace_hash",
            "a trace held by the bundle",
            p["trace_hash"],
            "a point names a trace the bundle does not hold",
        )
        bad = True
    return bad


def _figures(doc: Mapping[str, Any], ctx: Context) -> Mapping[str, Any]:
    figs = {h: trace_figures(t["ids"]) for h, t in ctx.traces.items()}
    # the layout with explanations is recognised by that field; older documents lack it
    hot = {h: f[1] for h, f in figs.items()} if "explanations" in doc else None
    classes = None
    if any(p.get("instances") is not None for p in doc["points"]):
        # schema 1.2: each instance's routing class, from the bundle's trace
        used = {i["trace_hash"] for p in doc["points"] for i in p.get("instances") or ()}
        classes = {h: trace_class(ctx.traces[h]["ids"], ctx.traces[h]["experts"]) for h in used}
        if hot is None:
            hot = {h: f[1] for h, f in figs.items()}
    return build_peers(
        doc["points"],
        ctx.runs,
        {h: f[0] for h, f in figs.items()},
        milestone=doc["milestone"],
        fingerprint_hash=doc["fingerprint_hash"],
        bandwidth_bytes_per_s=doc["bandwidth_bytes_per_s"],
        decode_max_tokens=doc["decode_max_tokens"],
        dispatch_cost=doc["dispatch_cost"],
        errors=doc["errors"],
        hot_shares=hot,
        rule=doc.get("rule"),
        routing_source=doc.get("routing_source"),
        trace_classes=classes,
        schema_version=doc["schema_version"],
        read_bandwidth_bytes_per_s=doc.get("read_bandwidth_bytes_per_s"),
        seed_salt=doc.get("seed_salt"),
        data_use=doc.get("data_use"),
        zero_shot=bool(doc.get("zero_shot")),
    )


KIND = ClaimKind(
    name="peers",
    document="peers.json",
    schema="mxdb.peers",
    codes=_code,
    units=(Unit("points", check=_point_ok),),
    figures=_figures,
    targets=lambda doc: targets_for(doc["schema_version"], bool(doc.get("zero_shot"))),
    settings=DECODE_SETTING,
    whole_document=True,
    report=(REPORT_FILE, render),
)
