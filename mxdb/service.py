"""One-shot operations behind the CLI: each opens the store, does one thing, closes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mxdb.errors import UsageError
from mxdb.shapes import MoEShape


def dispatch_once(
    db: str | None,
    shape: MoEShape,
    *,
    routing_trace: str | Path | None = None,
    routing_class: str | None = None,
    fingerprint_file: str | Path | None = None,
    policy: str = "strict",
    offline: bool = False,
    perf_model: str | Path | None = None,
) -> dict[str, Any]:
    """The dispatch decision for one call, as a JSON-ready dict (shape and routing included).

    Without ``fingerprint_file`` it answers for this host (``mxdb.hostinfo.host_fingerprint``:
    the live fingerprint on a GPU host, the GPU-free one with ``offline`` or without a GPU).
    With ``perf_model`` (a model.json) a family the store never measured here may be answered
    by that performance model; the model is loaded, and checked, before the store is opened.
    """
    from mxdb.dispatcher import Dispatcher, DispatchOptions
    from mxdb.fingerprint import load_fingerprint
    from mxdb.hostinfo import host_fingerprint
    from mxdb.store import Store

    # no refresher thread: one resolution, then the store is closed
    options = DispatchOptions(policy=policy, refresh_interval=0, model=perf_model)
    if routing_trace is not None and routing_class is not None:
        raise UsageError("give either --routing-trace or --routing-class, not both")
    features: dict[str, Any] | None = None
    if routing_trace is not None:
        from mxdb.routing import features as routing_features
        from mxdb.routing import load_topk

        ids = load_topk(routing_trace, experts=shape.experts)
        if ids.shape[1] != shape.topk:
            raise UsageError(
                f"routing trace {routing_trace} has k={ids.shape[1]} experts per token; "
                f"the shape has --topk {shape.topk}"
            )
        feats = routing_features(ids, shape.experts)
        routing_class = feats.routing_class
        features = feats.to_dict()
    if fingerprint_file:
        fingerprint, source = load_fingerprint(fingerprint_file), "file"
    else:
        host = host_fingerprint(offline=offline)
        fingerprint, source = host.fingerprint, host.source
    with Store.open(db, create=False) as store:
        dispatcher = Dispatcher(store, fingerprint, options)
        decision = dispatcher.resolve(shape, routing_class)
    out: dict[str, Any] = {
        "shape": {**shape.to_dict(), "family": shape.family},
        "routing_class": routing_class or dispatcher.options.default_routing_class,
        "fingerprint_hash": fingerprint.hash,
        "fingerprint_source": source,
        **decision.to_dict(),
        "config_short": decision.config.short() if decision.config is not None else None,
    }
    model = options.perf_model
    if model is not None:
        out["perf_model"] = model.path
        out["perf_model_fingerprint_hash"] = model.fingerprint_hash
    if features is not None:
        out["routing_features"] = features
    return out


def store_info(db: str | None) -> dict[str, Any]:
    """URL, schema revision and counts of the store."""
    from mxdb.store import Store

    with Store.open(db, create=False) as store:
        by_status = store.count_entries()
        return {
            "url": store.url,
            "dialect": store.dialect,
            "revision": store.revision(),
            "generation": store.generation(),
            "entries": sum(by_status.values()),
            "entries_by_status": by_status,
            "fingerprints": len(store.fingerprints()),
        }
