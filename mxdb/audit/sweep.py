"""The performance sweep (``sweep.json``) as a kind of evidence: its declaration for the claims
engine.

Per key: the shape is that of its family at its token count (``mxdb.shapes.preset_shape``,
bf16); every config (FlagGems' choice and each arm's) is a valid kernel config; FlagGems'
copies are one baseline and ``copies - 1`` controls, all of FlagGems' choice and timed; an arm
has one finite positive sample per round when its status is ``ok`` and none otherwise; the
counts hold one count per expert and sum to ``tokens * topk``; the routing class recomputed
from the counts is the recorded one; and the routing regenerated from its generator gives the
recorded counts and trace hash.  Every derived field and figure is recomputed with
:mod:`mxdb.evidence.sweep`'s own functions; the settings (rounds, copies, margin, method) are
mxdb's; a key (family, M, source) appears once.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from mxdb.audit.claims import ClaimKind, Context, Path_, Unit, check_samples
from mxdb.audit.findings import FindingSink
from mxdb.evidence.sweep import (
    COPIES,
    COPY_ROLES,
    MARGIN,
    METHOD,
    REPORT_FILE,
    ROUNDS,
    SWEEP_FILE,
    build_figures,
    config_hash_of,
    key_figures,
    render,
)
from mxdb.shapes import preset_shape

_ARM_CODES = {
    "median_us": "median_mismatch",
    "speedup": "speedup_mismatch",
    "outcome": "verdict_mismatch",
    "config_hash": "config_hash_mismatch",
}
_KEY_CODES = {
    "baseline_median_us": "median_mismatch",
    "noise_band": "noise_band_mismatch",
    "best": "best_mismatch",
}


def _code(path: Path_) -> str:
    if path[:1] == ("keys",) and len(path) >= 3:
        if path[2] == "arms":
            leaf = str(path[4]) if len(path) >= 5 else ""
            return _ARM_CODES.get(leaf, "field_mismatch")
        return _KEY_CODES.get(str(path[2]), "field_mismatch")
    if path[:1] == ("figures",):
        return "geomean_mismatch" if path[-1] == "geomean_best_speedup" else "count_mismatch"
    return "field_mismatch"


def _configs_ok(sink: FindingSink, rel: str, where: str, k: Mapping[str, Any]) -> bool:
    ok = True
    named = [("baseline", k["baseline"])]
    named += [(f"arms[{j}].config", a["config"]) for j, a in enumerate(k["arms"])]
    for field, cfg in named:
        try:
            config_hash_of(cfg)
        except Exception as exc:  # any invalid config is a finding, never a crash
            sink.add("sweep.config_invalid", rel, f"{where}.{field}", "a valid kernel config",
                     str(exc).splitlines()[0][:160], "the config does not parse")  # fmt: skip
            ok = False
    return ok


def _arms_ok(sink: FindingSink, rel: str, where: str, k: Mapping[str, Any], ctx: Context) -> bool:
    ok = True
    copies = [(j, a) for j, a in enumerate(k["arms"]) if a["role"] in COPY_ROLES]
    roles = [a["role"] for _, a in copies]
    want = ["baseline"] + ["control"] * (int(ctx.doc["copies"]) - 1)
    if sorted(roles) != want:
        sink.add("sweep.arms_invalid", rel, f"{where}.arms", f"roles {want}", roles,
                 "FlagGems' copies are one baseline and copies - 1 controls")  # fmt: skip
        ok = False
    for j, a in copies:
        if a["config"] != k["baseline"] or a["status"] != "ok":
            sink.add("sweep.arms_invalid", rel, f"{where}.arms[{j}]",
                     "FlagGems' choice, timed (status ok)", f"{a['status']} {a['config']}",
                     "a copy of FlagGems' choice is another config or was not timed")  # fmt: skip
            ok = False
    for j, a in enumerate(k["arms"]):
        n = len(a["samples"])
        want_n = k["rounds"] if a["status"] == "ok" else 0
        if n != want_n:
            sink.add("sweep.arms_invalid", rel, f"{where}.arms[{j}].samples",
                     f"{want_n} samples", n,
                     "an arm timed ok has one sample per round, any other none")  # fmt: skip
            ok = False
    if k["rounds"] != ctx.doc["rounds"]:
        sink.add("sweep.field_mismatch", rel, f"{where}.rounds", ctx.doc["rounds"], k["rounds"],
                 "a key is timed in the document's rounds")  # fmt: skip
        ok = False
    return ok


def _routing_ok(sink: FindingSink, rel: str, where: str, k: Mapping[str, Any]) -> None:
    from mxdb.routing import _classify_counts

    experts, topk, m = int(k["shape"]["experts"]), int(k["shape"]["topk"]), int(k["tokens"])
    counts = k["counts"]
    if len(counts) != experts or any(c < 0 for c in counts) or sum(counts) != m * topk:
        sink.add("sweep.counts_invalid", rel, f"{where}.counts",
                 f"{experts} counts summing to {m * topk}",
                 f"{len(counts)} counts summing to {sum(counts)}",
                 "one count per expert, every token's top-k slots counted once")  # fmt: skip
        return
    cls = _classify_counts(np.asarray(counts, dtype=np.int64), m, topk)
    if cls != k["routing_class"]:
        sink.add("sweep.class_mismatch", rel, f"{where}.routing_class", cls, k["routing_class"],
                 "the routing class is not the class of the counts")  # fmt: skip
    r = k["routing"]
    try:
        regen, h = _regenerated(json.dumps(r, sort_keys=True), m, experts, topk)
    except Exception as exc:  # parameters the generator refuses: a finding, never a crash
        sink.add("sweep.routing_mismatch", rel, f"{where}.routing", "a routing generator",
                 str(exc)[:160], "the routing cannot be regenerated")  # fmt: skip
        return
    if list(regen) != list(counts):
        sink.add("sweep.routing_mismatch", rel, f"{where}.counts", list(regen), counts,
                 "the counts are not those of the regenerated routing")  # fmt: skip
    if h != k["trace_hash"]:
        sink.add("sweep.routing_mismatch", rel, f"{where}.trace_hash", h, k["trace_hash"],
                 "the trace hash is not that of the regenerated routing")  # fmt: skip


@functools.lru_cache(maxsize=1024)
def _regenerated(routing: str, m: int, experts: int, topk: int) -> tuple[tuple[int, ...], str]:
    """The counts and trace hash of a routing generator's ids (``routing``: its JSON)."""
    from mxdb.routing import expert_counts, trace_hash
    from mxdb.routing_gen import generate

    r = json.loads(routing)
    ids = generate(str(r["kind"]), m, experts, topk, int(r["seed"]), **r["params"])
    counts = tuple(int(x) for x in expert_counts(np.asarray(ids), experts))
    return counts, trace_hash(ids, experts)


def _key_ok(sink: FindingSink, rel: str, where: str, k: Mapping[str, Any], ctx: Context) -> bool:
    try:
        want = preset_shape(k["family"], k["tokens"], "bf16").to_dict()
    except Exception:  # an unknown family: no shape can match
        want = {"family": k["family"], "tokens": k["tokens"]}
    if want != k["shape"]:
        sink.add("sweep.shape_mismatch", rel, f"{where}.shape", want, k["shape"],
                 "the shape is not that of the family at this token count (bf16)")  # fmt: skip
    ok = _configs_ok(sink, rel, where, k)
    ok &= _arms_ok(sink, rel, where, k, ctx)
    for j, a in enumerate(k["arms"]):
        ok &= check_samples(sink, rel, f"{where}.arms[{j}]", "sweep", {"samples": a["samples"]})
    _routing_ok(sink, rel, where, k)
    return ok


#: each key's recomputed fields of the audit under way (the key, then its fields), so that
#: the document's figures reuse the units' recomputation; cleared by each audit's preflight
_RECOMPUTED: dict[int, tuple[Mapping[str, Any], Mapping[str, Any]]] = {}


def _recomputed(k: Mapping[str, Any]) -> Mapping[str, Any]:
    hit = _RECOMPUTED.get(id(k))
    if hit is not None and hit[0] is k:
        return hit[1]
    fresh = key_figures(k)
    _RECOMPUTED[id(k)] = (k, fresh)
    return fresh


def _preflight(sink: FindingSink, rel: str, doc: Mapping[str, Any], _: Context) -> bool:
    _RECOMPUTED.clear()
    seen: dict[tuple[Any, ...], int] = {}
    for i, k in enumerate(doc["keys"]):
        key = (k["family"], k["tokens"], k["source"])
        if key in seen:
            sink.add("sweep.duplicate_key", rel, f"keys[{i}]", f"one key {key}",
                     f"also keys[{seen[key]}]", "a key (family, M, source) is recorded twice")  # fmt: skip
        seen.setdefault(key, i)
    return True


def _key(k: Mapping[str, Any], _: Context) -> Mapping[str, Any]:
    return _recomputed(k)


def _figures(doc: Mapping[str, Any], _: Context) -> Mapping[str, Any]:
    # the figures from the keys' recomputed fields, not their claimed ones
    out = {"figures": build_figures([{**k, **_recomputed(k)} for k in doc["keys"]])}
    _RECOMPUTED.clear()
    return out


KIND = ClaimKind(
    name="sweep",
    document=SWEEP_FILE,
    schema="mxdb.perf-sweep",
    codes=_code,
    units=(Unit("keys", check=_key_ok, figures=_key),),
    figures=_figures,
    preflight=_preflight,
    report=(REPORT_FILE, render),
    settings={
        "rounds": (ROUNDS, "every key is timed in 7 rounds"),
        "copies": (COPIES, "FlagGems' choice is timed 3 times per key (baseline and controls)"),
        "margin": (MARGIN, "the verdict's margin is the tuner's default verify margin"),
        "method": (METHOD, "every arm is timed by CUDA-graph replay"),
    },
)
