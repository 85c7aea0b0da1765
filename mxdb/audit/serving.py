"""The serving claim (``serving.json``, ``mxdb.serving``) declared for the claims engine.

The preflight checks the samples first (every timing sample and tokens/s chunk a finite
positive number), then the layout on valid samples: the hooked points' arms have one sample per
round (``setup.rounds``), each point's path is the one its hook counters and dispatch decision
give and its order seed its token count (the benchmark's); the healing part's chunk counts fit
its setup (steps, chunk, ladder repetitions) and the static phase slowed ``steps x slowed
layers`` calls.  It also checks the targets' statements, and ``report.md``, when present,
against :func:`mxdb.evidence.serving.render_report`.  On a valid layout the whole document is
rebuilt with :func:`mxdb.evidence.serving.build_serving` (the writer's own function, which
judges every point with :func:`mxdb.verdict.compare`) and its targets judged on its figures.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mxdb.audit.claims import ClaimKind, Context, Path_
from mxdb.audit.findings import FindingSink
from mxdb.evidence import stats
from mxdb.evidence.serving import (
    ARMS,
    HEALING_INPUTS,
    HOOKED_INPUTS,
    REPORT_FILE,
    SMALL_TOKENS_MAX,
    build_serving,
    flat_figures,
    hook_path,
    render_report,
    targets_for,
)

FALLBACK_PATHS = ("lean_fallback", "flaggems_fallback")
#: At most this many findings of one per-sample check.
MAX_ROW_FINDINGS = 20

_POINT_CODES: dict[str, str] = {
    "median_us": "median_mismatch",
    "stock_median_us_after_hooked": "median_mismatch",
    "stock_median_us_otherwise": "median_mismatch",
    "speedup": "speedup_mismatch",
    "speedup_low": "speedup_mismatch",
    "speedup_high": "speedup_mismatch",
    "median_ratio": "speedup_mismatch",
    "noise_band": "noise_band_mismatch",
    "control_pair_band": "noise_band_mismatch",
    "outcome": "verdict_mismatch",
    "verdict_reason": "verdict_mismatch",
    "rounds_hooked_slower": "verdict_mismatch",
    "slower_by_median_rule": "verdict_mismatch",
}


def _code(path: Path_) -> str:
    keys = [str(k) for k in path if not isinstance(k, int)]
    if keys[:2] == ["hooked", "points"] and len(keys) >= 3:
        return _POINT_CODES.get(keys[2], "field_mismatch")
    if keys[:2] == ["hooked", "figures"] and len(keys) >= 3:
        k = keys[2]
        if "geomean" in k:
            return "geomean_mismatch"
        return "capture_mismatch" if k == "capture_ok" else "count_mismatch"
    if keys[:2] == ["healing", "figures"] and len(keys) >= 3:
        k = keys[2]
        if k.startswith("ladder"):
            return "overhead_mismatch"
        if k.startswith("transitions") or k == "final_active":
            return "transition_mismatch"
        return "ratio_mismatch" if "_over_" in k else "throughput_mismatch"
    return "field_mismatch"


def _preflight(sink: FindingSink, rel: str, doc: Mapping[str, Any], ctx: Context) -> bool:
    specs = {t.name: t for t in targets_for(doc["schema_version"])}
    for i, t in enumerate(doc["targets"]):
        spec = specs.get(str(t.get("name")))
        if spec is not None and t.get("statement") != spec.statement:
            sink.add(
                "serving.target_threshold_mismatch",
                rel,
                f"targets[{i}].statement",
                spec.statement,
                t.get("statement"),
                f"target {spec.name}'s statement is not mxdb's",
            )
    # the layout is checked on valid samples only, and the figures on a valid layout
    return _samples_ok(sink, rel, doc) and _layout_ok(sink, rel, doc)


def _samples_ok(sink: FindingSink, rel: str, doc: Mapping[str, Any]) -> bool:
    series: list[tuple[str, list[Any]]] = []
    for i, p in enumerate(doc["hooked"]["points"]):
        series += [(f"hooked.points[{i}].samples.{k}", p["samples"][k]) for k in ARMS]
    smp = doc["healing"]["samples"]
    series += [(f"healing.samples.{k}", v) for k, v in smp.items() if k != "ladder"]
    series += [(f"healing.samples.ladder.{r}", xs) for r, xs in smp["ladder"].items()]
    bad = 0
    for where, xs in series:
        invalid = [j for j, x in enumerate(xs) if not stats.valid_sample(x)]
        if invalid and (bad := bad + 1) <= MAX_ROW_FINDINGS:
            j = invalid[0]
            sink.add(
                "serving.sample_invalid",
                rel,
                f"{where}[{j}]",
                "a finite positive number",
                xs[j],
                f"{len(invalid)} invalid sample(s)",
            )
    return bad == 0


def _layout_ok(sink: FindingSink, rel: str, doc: Mapping[str, Any]) -> bool:
    ok = True

    def add(field: str, want: Any, got: Any, msg: str) -> None:
        nonlocal ok
        ok = False
        sink.add("serving.layout_mismatch", rel, field, want, got, msg)

    hk = doc["hooked"]
    rounds = hk["setup"]["rounds"]
    if hk["setup"]["small_tokens_max"] != SMALL_TOKENS_MAX:
        add(
            "hooked.setup.small_tokens_max",
            SMALL_TOKENS_MAX,
            hk["setup"]["small_tokens_max"],
            "the issue's small points are those with M at most 16",
        )
    for i, p in enumerate(hk["points"]):
        lens = {k: len(p["samples"][k]) for k in ARMS}
        if set(lens.values()) != {rounds}:
            add(
                f"hooked.points[{i}].samples",
                f"{rounds} samples per arm (one per round)",
                lens,
                "the arms' samples are not one per round: no paired rounds",
            )
        want_path = hook_path(p["hook_stats"])
        if p["path"] != want_path:
            add(
                f"hooked.points[{i}].path",
                want_path,
                p["path"],
                "the path is not the one the point's hook counters give",
            )
        if (p["decision"]["config"] is None) != (p["path"] in FALLBACK_PATHS):
            add(
                f"hooked.points[{i}].path",
                "a fallback path" if p["decision"]["config"] is None else "a dispatched path",
                p["path"],
                "the path contradicts the recorded dispatch decision",
            )
        if p["order_seed"] != p["tokens"]:
            add(
                f"hooked.points[{i}].order_seed",
                p["tokens"],
                p["order_seed"],
                "the benchmark seeds each point's round order with its token count",
            )
    hl = doc["healing"]
    s, smp = hl["setup"], hl["samples"]
    layers = s["model"].get("layers")
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        add("healing.setup.model.layers", "a positive layer count", layers, "no layer count")
    rungs = [k for k in (*smp["ladder"], *s["ladder_order"]) if k != "off"]
    if any(not (k.isdigit() and int(k) > 0) for k in rungs):
        add(
            "healing.samples.ladder",
            "off and sampling intervals N > 0",
            sorted(smp["ladder"]),
            "a ladder rung is neither off nor a sampling interval",
        )
        return False
    steps, chunk = s["steps"], s["chunk"]
    want = {
        "clean": steps // chunk,
        "static_clean": steps // 2 // chunk,
        "static_injected": steps // chunk,
        "healing_clean": steps // 2 // chunk,
        "healing_injected": 2 * steps // chunk,
    }
    for k, n in want.items():
        if len(smp[k]) != n:
            add(
                f"healing.samples.{k}",
                f"{n} chunks",
                f"{len(smp[k])} chunks",
                "the phase's chunks do not fit its steps and chunk size",
            )
    if list(smp["ladder"]) and sorted(smp["ladder"]) != sorted(s["ladder_order"]):
        add(
            "healing.samples.ladder",
            s["ladder_order"],
            sorted(smp["ladder"]),
            "the ladder's rungs are not the ones the setup names",
        )
    for k, v in smp["ladder"].items():
        if len(v) != s["ladder_reps"]:
            add(
                f"healing.samples.ladder.{k}",
                f"{s['ladder_reps']} repetitions",
                len(v),
                "a ladder rung's repetitions are not the setup's",
            )
    slowed = steps * len(s["slow_layers"])
    if hl["slowed_calls"].get("static") != slowed:
        add(
            "healing.slowed_calls.static",
            slowed,
            hl["slowed_calls"].get("static"),
            "the static phase's injection did not slow every call of the slowed layers",
        )
    return ok


def _figures(doc: Mapping[str, Any], _: Context) -> Mapping[str, Any]:
    hk, hl = doc["hooked"], doc["healing"]
    return build_serving(
        {**{k: hk[k] for k in HOOKED_INPUTS}, "points": hk["points"]},
        {**{k: hl[k] for k in HEALING_INPUTS}, "ladder_counters": hl.get("ladder_counters")},
        milestone=doc["milestone"],
        fingerprint_hash=doc["fingerprint_hash"],
        notes=doc["notes"],
        schema_version=doc["schema_version"],
    )


KIND = ClaimKind(
    name="serving",
    document="serving.json",
    schema="mxdb.serving",
    codes=_code,
    figures=_figures,
    targets=lambda doc: targets_for(doc["schema_version"]),
    target_figures=flat_figures,
    preflight=_preflight,
    report=(REPORT_FILE, render_report),
    whole_document=True,
)
