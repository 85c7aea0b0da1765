"""The held-out check of the performance model (``check.json``): its declaration for the claims
engine.

Per point: every sample of an arm that ran a finite positive number, one per round (an arm that
did not run has none); the arms one ``baseline`` and two ``control`` copies of the point's
FlagGems config, then the candidate, which is the config of the point's plan entry (looked up
by family, token count and routing class; no candidate where the plan answers FlagGems' own
choice); the shape that of the family at the token count (bf16); the counts a routing of
``tokens * topk`` slots over the shape's experts, and the routing class the one
``mxdb.routing`` gives those counts; the routing instance regenerated from its recorded
generator, seed and parameters (``mxdb.routing_gen``, numpy only; at most
:data:`MAX_REGENERATED` router logits), whose trace hash and counts must be the recorded ones.
Every derived field and figure is recomputed with :mod:`mxdb.evidence.perfcheck`'s own
functions, and the targets judged on them (a missed target is a recorded fact; a document that
claims it met is a finding).

Document-wide: no two plan entries for one key and no two points for one instance; each plan
entry's ``answered`` is the gate's verdict on its confidence and predicted speedup (an entry
without a config is never answered and states no confidence); the gate is the model's.

The model and sweep bundles the document names must be folders beside this bundle (in the
parent folder of the bundle folder under audit; an audit that cannot say which folder that is
reports it) holding a ``model.json`` / ``sweep.json`` whose SHA-256 is the recorded one and
which declares ``mxdb.perf-model`` / ``mxdb.perf-sweep``; the sweep must be one the model
names among its ``sweeps`` (where it names them).

The plan is then recomputed (``mxdb.costmodel.train.lofo_plan`` over the sweep's ``keys``
with the model's ``training`` and the plan's sorted distinct token counts) and must equal the
recorded plan exactly.  That recomputation trains the leave-one-family-out models again
(about 12 s for a full sweep), so it needs scikit-learn; it runs when scikit-learn is
importable and both sibling documents carry the training data (the sweep's ``keys``, the
model's ``training``), as every document ``mxdb model train`` and
``benchmarks/perf_sweep.py`` write does.  A sibling document without it (one reduced to its
identity, as the hermetic tests write) is only hashed and checked as above.  Recomputed plans
are kept for the process, keyed by the two documents' SHA-256 and the token counts.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mxdb.audit.claims import ClaimKind, Context, Path_, Unit, check_samples
from mxdb.audit.compare import same
from mxdb.audit.findings import FindingSink
from mxdb.audit.siblings import sibling_bytes
from mxdb.configs import KernelConfig, config_hash
from mxdb.evidence.perfcheck import (
    CHECK_FILE,
    COPY_ROLES,
    MODEL_FILE,
    MODEL_SCHEMA,
    REPORT_FILE,
    SCHEMA,
    SETTINGS,
    SWEEP_FILE,
    SWEEP_SCHEMA,
    TARGETS,
    build_figures,
    plan_index,
    plan_key,
    point_figures,
    render,
)
from mxdb.fileio import parse_json

_POINT_CODES: dict[str, str] = {
    "candidate_speedup": "speedup_mismatch",
    "dispatch_speedup": "speedup_mismatch",
    "noise_band": "speedup_mismatch",
    "outcome": "verdict_mismatch",
    "plan_entry": "plan_mismatch",
    "answered": "plan_mismatch",
    "confidence": "plan_mismatch",
}
_CALIBRATION = ("calibration_error", "mean_confidence", "win_rate", "confidence_bins")
#: recomputed plans: (model.json SHA-256, sweep.json SHA-256, token counts) -> plan
_PLANS: dict[tuple[str, str, tuple[int, ...]], list[dict[str, Any]]] = {}
#: differing plan entries reported one by one (then one count)
_MAX_PLAN_FINDINGS = 5
#: the largest routing instance regenerated (tokens x experts logits; 4096 tokens over 256
#: experts, the largest of the presets, is a million)
MAX_REGENERATED = 1 << 24


def _code(path: Path_) -> str:
    if path[:1] == ("points",) and len(path) >= 3:
        if path[2] == "arms":
            return "median_mismatch" if path[-1] == "median_us" else "field_mismatch"
        return _POINT_CODES.get(str(path[2]), "field_mismatch")
    if path[:1] == ("figures",) and len(path) >= 2:
        key = str(path[1] if path[1] != "by_family" or len(path) < 4 else path[3])
        if key in _CALIBRATION:
            return "calibration_mismatch"
        return "geomean_mismatch" if key.startswith("geomean") else "count_mismatch"
    return "field_mismatch"


def _hash(config: Any) -> str:
    try:
        return config_hash(config)
    except Exception as exc:  # a config that cannot be hashed matches none
        return f"no hash ({type(exc).__name__})"


# -- points ---------------------------------------------------------------------------------


def _arms_ok(sink: FindingSink, rel: str, where: str, p: Mapping[str, Any]) -> bool:
    arms = p["arms"]
    copies = int(SETTINGS["copies"])
    roles = [a["role"] for a in arms]
    want = ["baseline", *(["control"] * (copies - 1))]
    ok = True
    if roles[:copies] != want or roles[copies:] not in ([], ["candidate"]):
        sink.add("perfcheck.arms_invalid", rel, f"{where}.arms",
                 f"roles {want} then at most one candidate", roles,
                 "a point times FlagGems' own choice as the baseline and its controls, then "
                 "the plan's config")  # fmt: skip
        ok = False
    rounds = int(SETTINGS["rounds"])
    for j, a in enumerate(arms):
        at = f"{where}.arms[{j}]"
        if a["status"] == "ok":
            ok &= check_samples(sink, rel, at, "perfcheck", {"samples": a["samples"]})
            if len(a["samples"]) != rounds:
                sink.add("perfcheck.sample_invalid", rel, f"{at}.samples", f"{rounds} samples",
                         len(a["samples"]), "an arm that ran has one sample per round")  # fmt: skip
                ok = False
        elif a["samples"]:
            sink.add("perfcheck.sample_invalid", rel, f"{at}.samples", "no samples",
                     len(a["samples"]), f"an arm with status {a['status']} did not run")  # fmt: skip
            ok = False
    base = _hash(p["baseline"])
    for j, a in enumerate(arms):
        if a["role"] in COPY_ROLES and _hash(a["config"]) != base:
            sink.add("perfcheck.config_mismatch", rel, f"{where}.arms[{j}].config", base,
                     _hash(a["config"]), "a copy of FlagGems' choice runs the point's baseline "
                     "config")  # fmt: skip
    return ok


def _routing_ok(sink: FindingSink, rel: str, where: str, p: Mapping[str, Any]) -> None:
    from mxdb.errors import MxdbError
    from mxdb.routing import _classify_counts, expert_counts, trace_hash
    from mxdb.routing_gen import generate
    from mxdb.shapes import preset_shape

    try:
        want = preset_shape(p["family"], p["tokens"], "bf16").to_dict()
    except MxdbError:  # an unknown family: no shape can match
        want = {"family": p["family"], "tokens": p["tokens"]}
    if want != p["shape"]:
        sink.add("perfcheck.shape_mismatch", rel, f"{where}.shape", want, p["shape"],
                 "the shape is not that of the family at this token count (bf16)")  # fmt: skip
    m, e, k = int(p["tokens"]), int(p["shape"]["experts"]), int(p["shape"]["topk"])
    counts = p["counts"]
    if len(counts) != e or min(counts, default=0) < 0 or sum(counts) != m * k:
        sink.add("perfcheck.routing_mismatch", rel, f"{where}.counts",
                 f"{e} non-negative counts summing to {m * k} (tokens x topk)",
                 f"{len(counts)} counts summing to {sum(counts)}",
                 "the counts are not a routing of the point's slots")  # fmt: skip
    else:
        cls = _classify_counts(np.asarray(counts, dtype=np.int64), m, k)
        if cls != p["routing_class"]:
            sink.add("perfcheck.routing_mismatch", rel, f"{where}.routing_class", cls,
                     p["routing_class"], "the routing class is not the class of the counts")  # fmt: skip
    r = p["routing"]
    if r["kind"] != SETTINGS["generator"]:
        sink.add("perfcheck.trace_mismatch", rel, f"{where}.routing.kind", SETTINGS["generator"],
                 r["kind"], "the held-out instances come from the check's own generator")  # fmt: skip
        return
    if m * e > MAX_REGENERATED:
        sink.add("perfcheck.trace_mismatch", rel, f"{where}.routing",
                 f"at most {MAX_REGENERATED:,} router logits (tokens x experts)", m * e,
                 "the instance is too large to regenerate")  # fmt: skip
        return
    try:
        ids = generate(str(r["kind"]), m, e, k, int(r["seed"]), **r["params"])
    except (MxdbError, TypeError, ValueError) as exc:
        sink.add("perfcheck.trace_mismatch", rel, f"{where}.routing", "a routing that can be "
                 "regenerated", str(exc)[:160], "the instance cannot be regenerated")  # fmt: skip
        return
    h = trace_hash(ids, e)
    if h != p["trace_hash"]:
        sink.add("perfcheck.trace_mismatch", rel, f"{where}.trace_hash", h, p["trace_hash"],
                 "the trace hash is not the hash of the regenerated instance")  # fmt: skip
    regen = [int(x) for x in expert_counts(ids, e)]
    if regen != list(counts):
        sink.add("perfcheck.trace_mismatch", rel, f"{where}.counts", "the regenerated counts",
                 "other counts", "the counts are not those of the regenerated instance")  # fmt: skip


def _point_ok(sink: FindingSink, rel: str, where: str, p: Mapping[str, Any], ctx: Context) -> bool:
    ok = _arms_ok(sink, rel, where, p)
    _routing_ok(sink, rel, where, p)
    if p["instance"] >= int(SETTINGS["instances"]):
        sink.add("perfcheck.field_mismatch", rel, f"{where}.instance",
                 f"an index below {SETTINGS['instances']}", p["instance"],
                 "more instances than the check's setting")  # fmt: skip
    entry = plan_index(ctx.doc["plan"]).get(plan_key(p))
    if entry is None:
        sink.add("perfcheck.plan_mismatch", rel, f"{where}.routing_class",
                 "a class the plan answers at this family and token count",
                 list(plan_key(p)), "the plan has no entry for the point")  # fmt: skip
        return False
    cand = next((a for a in p["arms"] if a["role"] == "candidate"), None)
    if entry["config"] is None and cand is not None:
        sink.add("perfcheck.config_mismatch", rel, f"{where}.arms", "no candidate",
                 _hash(cand["config"]), "the plan answers FlagGems' own choice here")  # fmt: skip
    elif entry["config"] is not None and (cand is None or _hash(cand["config"]) !=
                                          _hash(entry["config"])):  # fmt: skip
        sink.add("perfcheck.config_mismatch", rel, f"{where}.arms", _hash(entry["config"]),
                 "no candidate" if cand is None else _hash(cand["config"]),
                 "the candidate is not the config of the point's plan entry")  # fmt: skip
    return ok


def _point(p: Mapping[str, Any], ctx: Context) -> Mapping[str, Any]:
    return point_figures(p, plan_index(ctx.doc["plan"]))


# -- the document ---------------------------------------------------------------------------


def _statements(sink: FindingSink, rel: str, doc: Mapping[str, Any]) -> None:
    specs = {t.name: t for t in TARGETS}
    for i, t in enumerate(doc["targets"]):
        spec = specs.get(str(t.get("name")))
        if spec is not None and t.get("statement") != spec.statement:
            sink.add("perfcheck.target_threshold_mismatch", rel, f"targets[{i}].statement",
                     spec.statement, t.get("statement"),
                     f"target {spec.name}'s statement is not mxdb's")  # fmt: skip


def _plan_consistent(sink: FindingSink, rel: str, doc: Mapping[str, Any]) -> None:
    gate = doc["gate"]
    seen: dict[tuple[str, int, str], int] = {}
    for i, e in enumerate(doc["plan"]):
        where = f"plan[{i}]"
        key = plan_key(e)
        if key in seen:
            sink.add("perfcheck.plan_mismatch", rel, where, f"one entry for {list(key)}",
                     f"also plan[{seen[key]}]", "two plan entries answer one key")  # fmt: skip
        seen.setdefault(key, i)
        cfg, conf = e["config"], e["confidence"]
        if cfg is not None:
            try:
                KernelConfig.model_validate(cfg)
            except ValueError as exc:
                sink.add("perfcheck.plan_mismatch", rel, f"{where}.config", "a kernel config",
                         str(exc)[:160], "the plan's config is not a valid config")  # fmt: skip
        if cfg is None and conf is not None:
            sink.add("perfcheck.plan_mismatch", rel, f"{where}.confidence", None, conf,
                     "FlagGems' own choice states no confidence")  # fmt: skip
        admits = (
            cfg is not None and conf is not None and conf >= gate["min_confidence"]
            and e["predicted"] >= gate["min_speedup"]
        )  # fmt: skip
        if e["answered"] is not admits:
            sink.add("perfcheck.plan_mismatch", rel, f"{where}.answered", admits, e["answered"],
                     f"the gate (confidence >= {gate['min_confidence']:g}, predicted speedup >= "
                     f"{gate['min_speedup']:g}) {'answers' if admits else 'does not answer'} "
                     "this entry")  # fmt: skip


def _duplicates(sink: FindingSink, rel: str, doc: Mapping[str, Any]) -> None:
    seen: dict[tuple[Any, ...], int] = {}
    for i, p in enumerate(doc["points"]):
        key = (p["family"], p["tokens"], p["source"], p["instance"])
        if key in seen:
            sink.add("perfcheck.point_duplicate", rel, f"points[{i}]", "one point per instance",
                     f"{list(key)} (also points[{seen[key]}])",
                     "an instance is counted twice")  # fmt: skip
        seen.setdefault(key, i)


def _sibling(
    sink: FindingSink, rel: str, doc: Mapping[str, Any], key: str, file: str, schema: str
) -> tuple[dict[str, Any], str] | None:
    """The parsed document of the sibling bundle ``doc[key]`` names, and its SHA-256; None
    (with a finding) when it is absent, unreadable, another file or another document."""
    ref = doc[key]
    where = f"{key}.bundle"
    data = sibling_bytes(sink, rel, key, ref, file, code="perfcheck.bundle")
    if data is None:
        return None
    sha = str(ref["sha256"])  # what its bytes hash to
    try:
        parsed = parse_json(data, what=f"{ref['bundle']}/{file}")
    except Exception as exc:
        sink.add("perfcheck.bundle_mismatch", rel, where, f"a {schema} document",
                 str(exc)[:160], f"{ref['bundle']}/{file} cannot be read")  # fmt: skip
        return None
    if not isinstance(parsed, dict) or parsed.get("schema") != schema:
        found = parsed.get("schema") if isinstance(parsed, dict) else type(parsed).__name__
        sink.add("perfcheck.bundle_mismatch", rel, where, schema, found,
                 f"{ref['bundle']}/{file} is not a {schema} document")  # fmt: skip
        return None
    return parsed, sha


def _sklearn() -> bool:
    return importlib.util.find_spec("sklearn") is not None


def recomputed_plan(
    sweep: Mapping[str, Any], model: Mapping[str, Any], tokens: Sequence[int], key: tuple[str, str]
) -> list[dict[str, Any]]:
    """``lofo_plan`` of the sibling documents at ``tokens``, as JSON gives it back (cached by
    ``key``: the documents' SHA-256)."""
    from mxdb.costmodel.train import lofo_plan

    k = (*key, tuple(tokens))
    if k not in _PLANS:
        plan = lofo_plan(sweep["keys"], model["training"], tokens)
        _PLANS[k] = json.loads(json.dumps(plan))
    return _PLANS[k]


def _plan_recomputed(
    sink: FindingSink,
    rel: str,
    doc: Mapping[str, Any],
    model: tuple[dict[str, Any], str],
    sweep: tuple[dict[str, Any], str],
) -> None:
    mdoc, sdoc = model[0], sweep[0]
    if not (isinstance(mdoc.get("training"), dict) and isinstance(sdoc.get("keys"), list)):
        return  # siblings without training data: only hashed (module docstring)
    if not _sklearn():
        return
    tokens = sorted({int(e["tokens"]) for e in doc["plan"]})
    try:
        want = recomputed_plan(sdoc, mdoc, tokens, (model[1], sweep[1]))
    except Exception as exc:  # malformed training data: a finding, not a crash
        sink.add("perfcheck.plan_mismatch", rel, "plan", "the plan lofo_plan recomputes",
                 f"{type(exc).__name__}: {str(exc)[:160]}", "the plan cannot be recomputed")  # fmt: skip
        return
    got = list(doc["plan"])
    if len(got) != len(want):
        sink.add("perfcheck.plan_mismatch", rel, "plan", f"{len(want)} entries", len(got),
                 "the plan is not lofo_plan's (leave-one-family-out, recomputed)")  # fmt: skip
        return
    bad = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if not same(g, w, 0.0, 0.0)]
    for i in bad[:_MAX_PLAN_FINDINGS]:
        g, w = got[i], want[i]
        field = next((f for f in w if not same(g.get(f), w[f], 0.0, 0.0)), "")
        sink.add("perfcheck.plan_mismatch", rel, f"plan[{i}].{field}".rstrip("."),
                 w.get(field, w), g.get(field, g),
                 f"the plan entry is not lofo_plan's ({len(bad)} of {len(want)} differ)")  # fmt: skip


def _preflight(sink: FindingSink, rel: str, doc: Mapping[str, Any], _: Context) -> bool:
    _statements(sink, rel, doc)
    _plan_consistent(sink, rel, doc)
    _duplicates(sink, rel, doc)
    model = _sibling(sink, rel, doc, "model", MODEL_FILE, MODEL_SCHEMA)
    sweep = _sibling(sink, rel, doc, "sweep", SWEEP_FILE, SWEEP_SCHEMA)
    if model is not None:
        g = model[0].get("gate")
        want = (
            {"min_confidence": g.get("min_confidence"), "min_speedup": g.get("min_speedup")}
            if isinstance(g, dict) else None
        )  # fmt: skip
        if want is not None and not same(dict(doc["gate"]), want, 0.0, 0.0):
            sink.add("perfcheck.bundle_mismatch", rel, "gate", want, doc["gate"],
                     "the gate is not the model's")  # fmt: skip
    if model is not None and sweep is not None:
        named = model[0].get("sweeps")
        if isinstance(named, list) and sweep[1] not in {
            s.get("sha256") for s in named if isinstance(s, dict)
        }:
            sink.add("perfcheck.bundle_mismatch", rel, "sweep.sha256",
                     "the SHA-256 of a sweep the model was trained on", sweep[1],
                     "the sweep is not one of the model's")  # fmt: skip
        _plan_recomputed(sink, rel, doc, model, sweep)
    return True


def _figures(doc: Mapping[str, Any], _: Context) -> Mapping[str, Any]:
    # the figures from the points' recomputed fields, not their claimed ones
    index = plan_index(doc["plan"])
    points = [{**p, **point_figures(p, index)} for p in doc["points"]]
    return {"figures": build_figures(points)}


KIND = ClaimKind(
    name="perfcheck",
    document=CHECK_FILE,
    schema=SCHEMA,
    codes=_code,
    units=(Unit("points", check=_point_ok, figures=_point),),
    figures=_figures,
    targets=TARGETS,
    preflight=_preflight,
    report=(REPORT_FILE, render),
    settings={
        "settings": (
            SETTINGS,
            "the check's measurement: 8 rounds, 3 copies of FlagGems' choice, 3 instances of "
            "the logits generator, graph replay, margin 0.005",
        ),
    },
)
