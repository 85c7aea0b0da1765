"""Key reconciliation: one decision for a key whose traces were decided apart and disagree.

A workload's routing sources can fall in one routing class at one token count (Mixtral-8x7B at
M = 4: its uniform, Zipf and hot-expert traces all classify ``uniform``).  Each is a point of
its own, searched and verified on its own trace, so the key can end up with several rows: a
verified config of one trace, another config of the next, and a baseline record where a third
trace's choice lost a held-out instance (which the dispatcher then answers for all of them).
Reconciliation (``mxdb tune WORKLOAD --reconcile``, after the workload's tune) takes every key
of the workload with two points or more whose stored decisions differ, and times the configs
decided there, the peers' table rows and FlagGems' choice (with its same-config copies) on
every trace of the key (each point's replayed trace and held-out instances), interleaved in
randomized rounds, each checked against the float32 reference.  The key is decided once from
those comparisons (``key-N``, :func:`mxdb.pointverdict.decide_key`); the decision is stored
with source ``reconcile`` and the key's earlier rows become ``rejected``.  Points are claimed
and completed like a tune's (one transaction each; a second run resumes), and the runs, traces
and store export form a bundle the audit decides again.
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mxdb import pointverdict
from mxdb.configs import KernelConfig
from mxdb.models import DECIDED_STATUSES, Entry, Fingerprint, Measurement
from mxdb.shapes import MoEShape
from mxdb.store import Claim, Store
from mxdb.tune.backend import Backend
from mxdb.tune.search import (
    COPIES,
    PointInput,
    RoutingInput,
    _record_final,
    _Recorder,
    _validation_comparison,
)
from mxdb.tune.space import peer_seeds
from mxdb.tune.traces import Trace
from mxdb.tune.workload import Workload

#: The ``source`` of a reconciled key's entry.
SOURCE = "reconcile"


@dataclass
class ReconcileReport:
    """What a reconciliation did."""

    job: str
    keys: int
    decisions: list[dict[str, Any]] = field(default_factory=list)
    bundle: str | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _tag(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def conflicting_keys(
    workload: Workload, store: Store, fingerprint_hash: str
) -> list[tuple[str, dict[str, Any]]]:
    """The (point key, payload) of every key of ``workload`` measured on two traces or more
    whose decided rows (this fingerprint) differ in status or config."""
    from mxdb.tune.runner import build_points, validation_traces

    groups: dict[tuple[MoEShape, str], list[tuple[Any, Trace]]] = defaultdict(list)
    for p, replay, _ in build_points(workload):
        groups[(p.shape, replay.routing_class)].append((p, replay))
    out = []
    for (shape, cls), members in groups.items():
        if len(members) < 2:
            continue
        rows = [
            e
            for e in store.entries(
                op=shape.op,
                dtype=shape.dtype,
                family=shape.family,
                status=list(DECIDED_STATUSES),
                fingerprint_hash=fingerprint_hash,
            )
            if e.tokens == shape.tokens and e.routing_class == cls and e.id is not None
        ]
        if len({(e.status, e.config_hash) for e in rows}) < 2:
            continue
        traces: dict[str, Trace] = {}
        for p, replay in members:
            for t in (replay, *validation_traces(workload, p, replay)["heldout"]):
                traces.setdefault(t.trace_hash, t)
        ids = sorted(e.id for e in rows if e.id is not None)
        key = f"{shape.family}/{shape.dtype}/M{shape.tokens}/{cls}/rows-{_tag(str(ids))}"
        payload = {
            "dims": shape.dims(),
            "dtype": shape.dtype,
            "routing_class": cls,
            "rows": ids,
            "seed": workload.seed,
            "traces": [t.to_payload() for t in traces.values()],
        }
        out.append((key, payload))
    return out


def measure_key(
    job: str, claim: Claim, backend: Backend, options: Any, store: Store
) -> tuple[list[Measurement], list[Entry], list[tuple[int, str]]]:
    """Time and decide one key (see the module docstring); what to write with its completion."""
    from mxdb.tune.runner import _job_tag, _point_tag

    pl = claim.payload
    shape = _shape(pl["dims"], pl["dtype"])
    traces = [Trace.from_payload(t, shape.experts) for t in pl["traces"]]
    rows = [r for r in (store.get_entry(i) for i in pl["rows"]) if r.status in DECIDED_STATUSES]
    decided = {
        r.config_hash: KernelConfig.parse(r.config)
        for r in rows
        if r.status in ("verified", "parity")
    }
    peers = [c for c in peer_seeds(store, shape) if c.hash not in decided]
    base = backend.baseline_config(shape)
    arms = [c for c in (*decided.values(), *peers) if c.hash != base.hash]
    peer_hashes = {c.hash for c in peers}
    prefix = f"{_job_tag(job)}-{_point_tag(claim.key)}-{_tag(str(time.time()))[:6]}"
    point = PointInput(
        shape=shape,
        replay=_rin(traces[0]),
        synthetic=_rin(traces[0]),
        seed=int(pl.get("seed") or 0),
        run_prefix=prefix,
        fingerprint_hash=backend.fingerprint().hash,
    )
    rec = _Recorder(point, "graph")
    for i, t in enumerate(traces):
        name = f"{pointverdict.KEY_PREFIX}{i + 1}"
        routing = _rin(t)
        acc, failure, tag, common = _validation_comparison(
            backend, point, options, rec, name, shape, routing, arms, "graph"
        )
        for k, cfg in enumerate(arms):
            corr = backend.check(shape, routing.ids, cfg, seed=options.check_seed)
            _record_final(
                rec, cfg, "peer" if cfg.hash in peer_hashes else "candidate",
                acc[COPIES + k], failure.get(COPIES + k), routing, corr, f"{tag}-arm{k + 1:02d}",
                "layer", status_override="wrong" if not corr.passed else None, shape=shape,
                **common,
            )  # fmt: skip
    ms = [m.model_copy(update={"job": job}) for m in rec.items]
    decision = pointverdict.decide_key([pointverdict.arm_from_measurement(m) for m in ms])
    entries: list[Entry] = []
    rejections: list[tuple[int, str]] = []
    if decision.status != "none":
        config = (
            base
            if decision.status == "baseline"
            else next(c for c in arms if c.hash == decision.config_hash)
        )
        fp = backend.fingerprint()
        entry = Entry(
            op=shape.op, dtype=shape.dtype, family=shape.family, dims=shape.dims(),
            tokens=shape.tokens, routing_class=pl["routing_class"],
            config=config.model_dump(), config_hash=config.hash,
            fingerprint_hash=fp.hash, device_name=fp.device_name, status=decision.status,
            source=SOURCE, speedup=decision.speedup, noise_band=decision.noise_band,
            median_us=decision.median_us, baseline_us=decision.baseline_us,
            evidence=decision.evidence, confidence=decision.confidence,
            validation=decision.validation or None, job=job,
        )  # fmt: skip
        entries.append(entry)
        why = (
            f"reconciled over {len(traces)} traces of the key ({job}): "
            f"{decision.status} {decision.config_hash}"
        )
        rejections = [(r.id, why) for r in rows if r.id is not None]
    return ms, entries, rejections


def _rin(t: Trace) -> RoutingInput:
    return RoutingInput(t.ids, t.trace_hash, t.routing_class)


def reconcile(
    workload: Workload,
    backend: Backend,
    store_url: str,
    out_dir: str | Path,
    *,
    bundle: bool = True,
) -> ReconcileReport:
    """Reconcile every conflicting key of ``workload`` in the store (module docstring)."""
    from mxdb.tune.runner import job_name

    t0 = time.monotonic()
    fp = backend.fingerprint()
    job = f"{job_name(workload, fp)}-reconcile"
    with Store.open(store_url) as store:
        store.put_fingerprint(fp)
        store.add_points(job, conflicting_keys(workload, store, fp.hash))
        worker = f"reconcile:{_tag(str(time.time()))}"
        while (claim := store.claim_point(job, worker)) is not None:
            ms, entries, rejections = measure_key(job, claim, backend, workload.search, store)
            store.complete_point(claim, entries=entries, measurements=ms, rejections=rejections)
        states = store.points(job)
        made = store.entries(fingerprint_hash=fp.hash, source=SOURCE, job=job)
        path = None
        if bundle and made:
            path = write_bundle(store, job, workload, fp, made, Path(out_dir))
    return ReconcileReport(
        job=job,
        keys=len(states),
        decisions=[_summary(e) for e in made],
        bundle=str(path) if path else None,
        seconds=time.monotonic() - t0,
    )


def write_bundle(
    store: Store,
    job: str,
    workload: Workload,
    fp: Fingerprint,
    entries: Sequence[Entry],
    out_dir: Path,
) -> Path:
    """The reconciliation's bundle: every key's runs and traces, and the decided entries."""
    from mxdb.evidence.writer import BundleWriter
    from mxdb.fingerprint import environment_data
    from mxdb.interop.export import StoreExport
    from mxdb.tune.runner import record_run

    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    root = out_dir / f"{workload.name}-reconcile-{stamp}-{_tag(job + stamp)[:4]}"
    w = BundleWriter(
        root, milestone=workload.name, fingerprint=fp, fingerprint_data=environment_data()
    )
    for _, payload in store.point_payloads(job):
        shape = _shape(payload["dims"], payload["dtype"])
        for t in payload["traces"]:
            tr = Trace.from_payload(t, shape.experts)
            w.add_trace(tr.ids, experts=shape.experts, generator=tr.generator)
    version = pointverdict.RUN_SCHEMA_OF_RULE[pointverdict.RULE]
    for m in store.measurements(job=job):
        record_run(w, m, _shape(m.dims, m.dtype), version)
    w.set_store_export(StoreExport(fingerprints={fp.hash: fp}, entries=list(entries)))
    w.finish(bandwidth_bytes_per_s=None)
    return root


def _shape(dims: dict[str, Any], dtype: str) -> MoEShape:
    return MoEShape(
        dims["experts"], dims["hidden"], dims["intermediate"], dims["topk"], dims["tokens"], dtype
    )


def _summary(e: Entry) -> dict[str, Any]:
    keys = ("family", "tokens", "routing_class", "status", "config_hash", "speedup", "confidence")
    return {k: getattr(e, k) for k in keys}
