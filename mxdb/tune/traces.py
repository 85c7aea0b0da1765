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
from mxdb.tune.workload import HotRouting, ReplayRouting, RoutingSource, Workload, ZipfRouting


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
    return {}


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


def _seed(base: int, shape: MoEShape, label: str) -> int:
    text = f"{base}|{shape.family}|{shape.dtype}|{shape.tokens}|{label}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")


def _read_replay(workload: Workload, src: ReplayRouting, shape: MoEShape) -> np.ndarray:
    path = workload.resolve(src.path)
    from mxdb.fileio import MAX_TRACE_JSON_BYTES, load_json

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
    # the first M tokens; a shorter trace is repeated cyclically to M tokens
    reps = -(-shape.tokens // ids.shape[0])
    return np.tile(ids, (reps, 1))[: shape.tokens]
