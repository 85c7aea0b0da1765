"""The routing each tuning point replays, and the synthetic routing its cheap rungs use.

A point's trace is generated once from the workload seed (``mxdb.routing_gen``) or read from a
replay file, hashed (evidence definition: SHA-256 of canonical JSON ``{experts, ids}``) and put
into the point's payload, so that every worker and every candidate replays the identical ids.
The synthetic routing is of the same kind with another seed: the replayed trace stays held out
of the halving rungs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from mxdb import routing, routing_gen
from mxdb.errors import TraceError, WorkloadError
from mxdb.evidence.files import trace_hash
from mxdb.shapes import MoEShape
from mxdb.tune.workload import (
    HotRouting,
    ReplayRouting,
    RoutingSource,
    SparseRouting,
    Workload,
    ZipfRouting,
)


@dataclass(frozen=True)
class Trace:
    """Top-k ids ``[tokens, topk]`` with their hash, class and how they were made."""

    ids: np.ndarray
    trace_hash: str
    routing_class: str
    generator: dict[str, Any]

    def to_payload(self) -> dict[str, Any]:
        return {
            "ids": self.ids.tolist(),
            "trace_hash": self.trace_hash,
            "routing_class": self.routing_class,
            "generator": self.generator,
        }

    @classmethod
    def from_payload(cls, data: dict[str, Any], experts: int) -> Trace:
        ids = np.asarray(data["ids"], dtype=np.int64)
        h = trace_hash(experts, ids.tolist())
        if h != data["trace_hash"]:
            raise TraceError(
                f"trace in the work payload hashes to {h}, not {data['trace_hash']}; "
                "the store row was altered: re-create the job"
            )
        return cls(ids, h, str(data["routing_class"]), dict(data["generator"]))


def _params(src: RoutingSource) -> dict[str, Any]:
    if isinstance(src, ZipfRouting):
        return {"exponent": src.exponent}
    if isinstance(src, HotRouting):
        return {"fraction": src.fraction, "expert": src.expert}
    if isinstance(src, SparseRouting):
        return {"active": src.active}
    return {}


#: Relative range over which held-out instances perturb a source's parameter (x U(low, high)).
JITTER = (0.7, 1.4)
#: Relative range of a perturbed sparse instance's active fraction.
SPARSE_ACTIVE = (0.5, 3.0)
#: Largest Zipf exponent among the active experts of a perturbed sparse instance.
SPARSE_SKEW_MAX = 1.2


def jittered_params(src: RoutingSource, shape: MoEShape, seed: int) -> dict[str, Any]:
    """``src``'s parameters perturbed (deterministically from ``seed``): a Zipf exponent or a
    hot fraction scaled by :data:`JITTER`, another hot expert, a sparse source's active
    fraction scaled by :data:`SPARSE_ACTIVE` and its active experts' load skewed (Zipf, up to
    :data:`SPARSE_SKEW_MAX`)."""
    rng = np.random.default_rng((seed ^ 0x5F3759DF) % 2**32)
    scale = float(rng.uniform(*JITTER))
    if isinstance(src, ZipfRouting):
        return {"exponent": round(src.exponent * scale, 4)}
    if isinstance(src, HotRouting):
        fraction = min(1.0, max(0.05, src.fraction * scale))
        return {"fraction": round(fraction, 4), "expert": int(rng.integers(shape.experts))}
    if isinstance(src, SparseRouting):
        # the sparse class spans from a few active experts to about three quarters of them:
        # draw the active fraction over SPARSE_ACTIVE times the source's (instances that leave
        # the class are redrawn by the caller)
        active = min(1.0, src.active * float(rng.uniform(*SPARSE_ACTIVE)))
        return {"active": round(active, 4), "s": round(float(rng.uniform(0, SPARSE_SKEW_MAX)), 4)}
    return _params(src)


def generate(kind: str, shape: MoEShape, seed: int, params: dict[str, Any]) -> np.ndarray:
    """Generated top-k ids for ``shape`` (``mxdb.routing_gen``)."""
    # the workload's field names -> the generator's parameter names
    names = {"exponent": "s", "expert": "hot_expert"}
    gen_params = {names.get(k, k): v for k, v in params.items()}
    ids: Any = routing_gen.generate(
        kind, shape.tokens, shape.experts, shape.topk, seed, **gen_params
    )
    return np.asarray(ids, dtype=np.int64)


def classify(ids: np.ndarray, experts: int) -> str:
    """The routing class of ``ids`` (``mxdb.routing``'s classifier)."""
    cls: Any = routing.classify(routing.features(ids, experts))
    return str(getattr(cls, "value", cls))


def point_traces(workload: Workload, shape: MoEShape, routing_index: int) -> tuple[Trace, Trace]:
    """The (replayed, synthetic) traces of one point."""
    src = workload.routings[routing_index]
    seed = _seed(workload.seed, shape, src.label())
    if isinstance(src, ReplayRouting):
        ids = _read_replay(workload, src, shape)
        gen: dict[str, Any] = {"kind": "captured", "seed": None, "params": {"path": src.path}}
        syn_kind, syn_params = "uniform", {}
    else:
        ids = generate(src.kind, shape, seed, _params(src))
        gen = {"kind": src.kind, "seed": seed, "params": _params(src)}
        syn_kind, syn_params = src.kind, _params(src)
    cls = classify(ids, shape.experts)
    replay = Trace(ids, trace_hash(shape.experts, ids.tolist()), cls, gen)
    syn_seed = (seed + 0x9E3779B1) % 2**32
    syn_ids = generate(syn_kind, shape, syn_seed, syn_params)
    synthetic = Trace(
        syn_ids,
        trace_hash(shape.experts, syn_ids.tolist()),
        cls,
        {"kind": syn_kind, "seed": syn_seed, "params": syn_params},
    )
    return replay, synthetic


#: Draws tried per held-out instance before giving up on finding one of the point's class.
HELDOUT_TRIES = 8


def heldout_traces(
    workload: Workload, shape: MoEShape, routing_index: int, replay: Trace, count: int
) -> list[Trace]:
    """``count`` routing instances of ``replay``'s class that the search never sees.

    Generated sources draw fresh seeds from the same generator and keep instances that fall in
    the point's class; a replayed trace gives its held-out windows (the next ``M`` tokens after
    the replayed ones, and so on).  Fewer than ``count`` come back when the source has no more.
    """
    src = workload.routings[routing_index]
    out: list[Trace] = []
    if isinstance(src, ReplayRouting):
        rows = _read_replay_rows(workload, src, shape)
        m = shape.tokens
        for w in range(1, count + 1):
            window = rows[w * m : (w + 1) * m]
            if window.shape[0] < m:
                break
            cls = classify(window, shape.experts)
            gen: dict[str, Any] = {
                "kind": "captured",
                "seed": None,
                "params": {"path": src.path, "window": w},
            }

            out.append(Trace(window, trace_hash(shape.experts, window.tolist()), cls, gen))
        return out
    base = _seed(workload.seed, shape, src.label() + "|heldout")
    for i in range(count * HELDOUT_TRIES):
        if len(out) == count:
            break
        seed = (base + i) % 2**32
        # the first instance keeps the workload's parameters; the others perturb them, so a
        # verified entry has also won on routings of its class that its source does not draw
        params = _params(src) if not out else jittered_params(src, shape, seed)
        ids = generate(src.kind, shape, seed, params)
        cls = classify(ids, shape.experts)
        if cls != replay.routing_class:
            continue
        gen = {"kind": src.kind, "seed": seed, "params": params}
        out.append(Trace(ids, trace_hash(shape.experts, ids.tolist()), cls, gen))
    return out


def source_instances(workload: Workload, shape: MoEShape, routing_index: int) -> list[Trace]:
    """One fresh instance of each *other* generated routing source of the workload at the
    point's token count: what an answer for an adjacent routing class relies on."""
    out: list[Trace] = []
    for j, src in enumerate(workload.routings):
        if j == routing_index or isinstance(src, ReplayRouting):
            continue
        seed = _seed(workload.seed, shape, src.label() + "|class-check")
        ids = generate(src.kind, shape, seed, _params(src))
        gen: dict[str, Any] = {"kind": src.kind, "seed": seed, "params": _params(src)}
        cls = classify(ids, shape.experts)
        out.append(Trace(ids, trace_hash(shape.experts, ids.tolist()), cls, gen))
    return out


def neighbour_tokens(tokens: int) -> list[int]:
    """The token counts half-way (geometric) to a point's neighbours at half and double M."""
    out = []
    for t in (round(tokens / 2**0.5), round(tokens * 2**0.5)):
        if t >= 1 and t != tokens and t not in out:
            out.append(t)
    return out


def neighbour_traces(
    workload: Workload, shape: MoEShape, routing_index: int, replay: Trace
) -> list[Trace]:
    """One held-out instance at each of :func:`neighbour_tokens` (any class it falls in)."""
    out: list[Trace] = []
    for t in neighbour_tokens(shape.tokens):
        sub = shape.with_tokens(t)
        got = heldout_traces(workload, sub, routing_index, replay, 1)
        if not got:
            # the class at a neighbouring count may differ: keep the first instance drawn
            src = workload.routings[routing_index]
            if isinstance(src, ReplayRouting):
                continue
            seed = _seed(workload.seed, sub, src.label() + "|heldout")
            ids = generate(src.kind, sub, seed, _params(src))
            gen = {"kind": src.kind, "seed": seed, "params": _params(src)}
            got = [
                Trace(ids, trace_hash(sub.experts, ids.tolist()), classify(ids, sub.experts), gen)
            ]
        out.append(got[0])
    return out


def _seed(base: int, shape: MoEShape, label: str) -> int:
    text = f"{base}|{shape.family}|{shape.dtype}|{shape.tokens}|{label}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")


def _read_replay(workload: Workload, src: ReplayRouting, shape: MoEShape) -> np.ndarray:
    """The first M tokens of a replay trace; a shorter trace is repeated cyclically to M."""
    ids = _read_replay_rows(workload, src, shape)
    reps = -(-shape.tokens // ids.shape[0])
    return np.tile(ids, (reps, 1))[: shape.tokens]


def _read_replay_rows(workload: Workload, src: ReplayRouting, shape: MoEShape) -> np.ndarray:
    """Every row of a replay trace, checked against ``shape`` (its windows past the first M
    tokens are the point's held-out instances)."""
    from mxdb.fileio import MAX_TRACE_JSON_BYTES, load_json

    path = workload.resolve(src.path)
    if not path.exists():
        raise WorkloadError(
            f"routings: replay trace {str(path)!r} does not exist; record one with `mxdb trace` "
            "or point path at an evidence traces/<hash>.json file"
        )
    doc = load_json(path, what="replay trace", limit=MAX_TRACE_JSON_BYTES, error=WorkloadError)
    rows = doc.get("ids") if isinstance(doc, dict) else doc
    try:
        ids = np.asarray(rows, dtype=np.int64)
    except (TypeError, ValueError):
        raise WorkloadError(
            f"replay trace {path}: ids must be a [tokens][topk] integer list"
        ) from None
    if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] != shape.topk:
        raise WorkloadError(
            f"replay trace {path}: has shape {list(ids.shape)}, needs [tokens][{shape.topk}] "
            f"for {shape.family}"
        )
    if ids.min() < 0 or ids.max() >= shape.experts:
        raise WorkloadError(f"replay trace {path}: expert ids must lie in [0, {shape.experts})")
    return ids
