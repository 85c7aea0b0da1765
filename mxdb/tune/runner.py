"""``tune``: split a workload into points, let workers claim and measure them, write evidence.

Work sharing has one mechanism at every scale: the points of a job live in the store, and a
worker *claims* one (``Store.claim_point``), renews its lease while it measures, and writes
the point's measurements and verified entry together with the point's completion in one
transaction (``Store.complete_point``).  One worker per GPU (``devices=[0, 1]``: spawned
processes with ``CUDA_VISIBLE_DEVICES`` set), several hosts against one PostgreSQL store, or a
worker killed mid-point and a second run: each point is measured by exactly one worker, and
nothing is half-written or verified twice.

The job is named after the workload's content and the environment fingerprint, so that only
identical environments share work.  At the end the evidence bundle (runs, traces, fingerprint,
summary, manifest, store export of the verified entries) is assembled from the store.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mxdb import pointverdict, verdict
from mxdb.configs import KernelConfig
from mxdb.errors import MxdbError, UsageError
from mxdb.fingerprint import environment_data
from mxdb.models import DECIDED_STATUSES, SINGLE_SOURCE, Entry, Fingerprint, Measurement
from mxdb.shapes import MoEShape
from mxdb.store import Claim, Store
from mxdb.tune.backend import Backend
from mxdb.tune.search import PointInput, RoutingInput, SearchResult, search
from mxdb.tune.space import SearchSpace, peer_seeds
from mxdb.tune.traces import (
    Trace,
    heldout_traces,
    neighbour_traces,
    point_traces,
    source_instances,
)
from mxdb.tune.verify import point_entry, single_record
from mxdb.tune.workload import Point, SearchOptions, Workload

if TYPE_CHECKING:
    from mxdb.costmodel.model import PerfModel

BackendFactory = Callable[[], Backend]
#: Seconds a claim lasts without renewal; a heartbeat renews it every third of that.
LEASE_S = 120.0


#: A tie (a baseline or parity record) decided under a wider noise band than this (FlagGems'
#: same-config copies apart by more) could not tell configs this close apart: the measurement
#: was disturbed (another process on the GPU, clocks), and the key deserves a second one.  A
#: verified entry needs its whole interval past the margin, so noise cannot make one.
NOISY_BAND = 0.02


def noisy_records(entries: Iterable[Any], band: float = NOISY_BAND) -> list[dict[str, Any]]:
    """The baseline and parity records among ``entries`` decided under a noise band wider than
    ``band``."""
    return [
        {
            "family": e.family,
            "dtype": e.dtype,
            "tokens": e.tokens,
            "routing_class": e.routing_class,
            "status": e.status,
            "noise_band": e.noise_band,
        }
        for e in entries
        if e.status in ("baseline", "parity") and e.noise_band is not None and e.noise_band > band
    ]


@dataclass
class TuneReport:
    """What a ``tune`` call did."""

    job: str
    workload: str
    fingerprint_hash: str
    points_total: int
    points_done: int
    points_measured: int
    verified: list[dict[str, Any]] = field(default_factory=list)
    #: keys measured where FlagGems' own choice was not beaten (stored as ``baseline`` entries)
    baseline_keys: int = 0
    #: keys that answer a peer's table row at parity with FlagGems' choice (``parity``)
    parity_keys: int = 0
    #: baseline and parity records decided under a noise band wider than :data:`NOISY_BAND` (one
    #: dict per key: family, dtype, tokens, routing class, status, noise band): measure again
    noisy: list[dict[str, Any]] = field(default_factory=list)
    bundle: str | None = None
    #: every bundle written: one per routing source when the workload has several (two
    #: sources can fall into one routing class at small M, and a bundle's comparison group,
    #: keyed by shape, M and class, must replay one trace)
    bundles: list[str] = field(default_factory=list)
    budget_exhausted: bool = False
    seconds: float = 0.0
    workers: int = 1

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def gpu_backend_factory(device_index: int = 0) -> Backend:
    """The GPU backend (imports torch, triton and flag_gems, lazily)."""
    from mxdb.kernels.backend import GpuBackend

    backend: Backend = GpuBackend(device_index=device_index)
    return backend


def job_name(workload: Workload, fingerprint: Fingerprint) -> str:
    return f"{workload.name}-{workload.content_hash[:10]}-{fingerprint.hash[:10]}"


def _job_tag(job: str) -> str:
    import hashlib

    return hashlib.sha256(job.encode()).hexdigest()[:8]


def _point_tag(key: str) -> str:
    import hashlib

    return hashlib.sha256(key.encode()).hexdigest()[:8]


def build_points(workload: Workload) -> list[tuple[Point, Trace, Trace]]:
    """Every point with its replayed and synthetic traces."""
    out = []
    for p in workload.points():
        replay, synthetic = point_traces(workload, p.shape, p.routing_index)
        out.append((p, replay, synthetic))
    return out


def validation_traces(workload: Workload, point: Point, replay: Trace) -> dict[str, list[Trace]]:
    """A point's held-out instances of its class and at neighbouring token counts."""
    opts = workload.search
    heldout = heldout_traces(workload, point.shape, point.routing_index, replay, opts.heldout)
    neighbours = (
        neighbour_traces(workload, point.shape, point.routing_index, replay)
        if opts.neighbour_tokens
        else []
    )
    classes = source_instances(workload, point.shape, point.routing_index)
    return {"heldout": heldout, "neighbours": neighbours, "classes": classes}


def tune(
    workload: Workload,
    *,
    store_url: str | None = None,
    out_dir: str | os.PathLike[str] = "evidence",
    budget_minutes: float | None = None,
    devices: Sequence[int] | None = None,
    backend_factory: BackendFactory | None = None,
    progress: bool = True,
    lease_s: float = LEASE_S,
    bundle: bool = True,
    perf_model: PerfModel | None = None,
) -> TuneReport:
    """Tune every point of ``workload``; see the module docstring.

    ``perf_model``: a learned performance model that orders and prunes the first rung of every
    point's search (``mxdb.tune.search``; ``SearchOptions.model_keep``)."""
    t0 = time.monotonic()
    factory = backend_factory or gpu_backend_factory
    budget = budget_minutes if budget_minutes is not None else workload.search.budget_minutes
    if budget is not None and budget <= 0:
        raise UsageError(f"--budget must be a positive number of minutes, got {budget}")
    deadline = time.time() + budget * 60 if budget is not None else None
    if devices is not None and len(set(devices)) != len(devices):
        raise UsageError(f"--devices lists a device twice: {list(devices)}")

    # the coordinator's backend: fingerprint only when workers are separate processes
    local_backend = factory()
    try:
        return _tune(
            workload, local_backend, factory, store_url, out_dir, deadline, devices, lease_s,
            progress, bundle, t0, perf_model,
        )  # fmt: skip
    finally:
        # shut its compile pool down in order: a pool left to the interpreter's exit is
        # terminated, and its workers' semaphores and processes are never cleaned up
        close_backend(local_backend)


def close_backend(backend: Any) -> None:
    """Close a backend that owns processes or pools (``close()``); others need nothing."""
    close = getattr(backend, "close", None)
    if callable(close):
        close()


def _tune(
    workload: Workload,
    local_backend: Backend,
    factory: BackendFactory,
    store_url: str | None,
    out_dir: str | os.PathLike[str],
    deadline: float | None,
    devices: Sequence[int] | None,
    lease_s: float,
    progress: bool,
    bundle: bool,
    t0: float,
    perf_model: PerfModel | None = None,
) -> TuneReport:
    fp = local_backend.fingerprint()
    job = job_name(workload, fp)
    points = build_points(workload)
    # held-out instances are drawn once: stored with each point, written into its bundle
    extras = {p.key: validation_traces(workload, p, r) for p, r, _ in points}
    with Store.open(store_url) as store:
        url = store_url or _raw_url(store)
        store.put_fingerprint(fp)
        store.add_points(
            job,
            [
                (
                    p.key,
                    {
                        **p.payload(),
                        "replay": r.to_payload(),
                        "synthetic": s.to_payload(),
                        **{k: [t.to_payload() for t in v] for k, v in extras[p.key].items()},
                    },
                )
                for p, r, s in points
            ],
        )
    total = len(points)
    measured = 0
    if devices:
        close_backend(local_backend)
        measured = _run_processes(
            job, url, workload.search, fp.hash, factory, devices, deadline, lease_s, progress,
            total, perf_model,
        )  # fmt: skip
        workers = len(devices)
    else:
        with Store.open(url) as store:
            bar = _Progress(total, progress, store, job)
            measured = work(
                job,
                store,
                local_backend,
                workload.search,
                fp.hash,
                deadline,
                lease_s,
                on_done=bar.advance,
                model=perf_model,
            )
            bar.close()
        workers = 1

    with Store.open(url) as store:
        states = store.points(job)
        done = sum(1 for s in states if s.state == "done")
        entries = _job_entries(store, job, fp.hash)
        paths: list[Path] = []
        if bundle and done:
            paths = write_bundles(
                store, job, workload, fp, points, entries, Path(out_dir), extras=extras
            )
        path = paths[0] if paths else None
    return TuneReport(
        job=job,
        workload=workload.name,
        fingerprint_hash=fp.hash,
        points_total=total,
        points_done=done,
        points_measured=measured,
        verified=[
            {
                "family": e.family,
                "dtype": e.dtype,
                "tokens": e.tokens,
                "routing_class": e.routing_class,
                "config": e.config,
                "speedup": e.speedup,
                "noise_band": e.noise_band,
            }
            for e in entries
            if e.status == "verified"
        ],
        baseline_keys=sum(1 for e in entries if e.status == "baseline"),
        parity_keys=sum(1 for e in entries if e.status == "parity"),
        noisy=noisy_records(entries),
        bundle=str(path) if path else None,
        bundles=[str(p) for p in paths],
        budget_exhausted=done < total and deadline is not None and time.time() >= deadline,
        seconds=time.monotonic() - t0,
        workers=workers,
    )


def _raw_url(store: Store) -> str:
    # the store masks passwords in .url; the default URL has none
    from mxdb.store import default_url

    return default_url()


# -- workers ----------------------------------------------------------------------------------


def work(
    job: str,
    store: Store,
    backend: Backend,
    options: SearchOptions,
    fingerprint_hash: str,
    deadline: float | None,
    lease_s: float = LEASE_S,
    *,
    worker: str | None = None,
    on_done: Callable[[], None] | None = None,
    model: PerfModel | None = None,
) -> int:
    """Claim and measure points of ``job`` until none is left or the deadline passes
    (``model``: the performance model every point's search is ordered by, if any)."""
    own = backend.fingerprint().hash
    if own != fingerprint_hash:
        raise MxdbError(
            f"this worker's environment fingerprint is {own}, the job's is {fingerprint_hash}; "
            "run workers of one job in one environment"
        )
    worker = worker or f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
    space_cache: dict[tuple[int, ...], SearchSpace] = {}
    n = 0
    warm = False
    while deadline is None or time.time() < deadline:
        claim = store.claim_point(job, worker, lease_s)
        if claim is None:
            break
        if not warm:
            # start the compile pool before the first point's budget starts counting: its
            # start-up (spawning workers, importing the compiler) belongs to no point
            warm_up(backend, Point.from_payload(claim.payload).shape)
            warm = True
        stop = threading.Event()
        beat = threading.Thread(target=_heartbeat, args=(store, claim, lease_s, stop), daemon=True)
        beat.start()
        try:
            ms, entries, rejections = measure_point(
                job, claim, backend, options, fingerprint_hash, deadline, store, space_cache,
                model=model,
            )  # fmt: skip
        finally:
            stop.set()
            beat.join()
        if store.complete_point(claim, entries=entries, measurements=ms, rejections=rejections):
            n += 1
            if on_done is not None:
                on_done()
    return n


def warm_up(backend: Backend, shape: MoEShape) -> float:
    """Start the backend's compile machinery; returns the seconds it took.

    Calls the backend's optional ``warm_up()`` and compiles FlagGems' choice for ``shape`` (the
    baseline every point times anyway), so that a worker's first point does not pay for the
    compile pool's start-up out of its own budget.
    """
    t0 = time.monotonic()
    hook = getattr(backend, "warm_up", None)
    if callable(hook):
        hook()
    backend.compile(shape, [backend.baseline_config(shape)])
    return time.monotonic() - t0


def _heartbeat(store: Store, claim: Claim, lease_s: float, stop: threading.Event) -> None:
    while not stop.wait(lease_s / 3):
        try:
            if not store.renew_claim(claim, lease_s):
                return
        except MxdbError:
            continue  # a transient store error: try again at the next beat


def measure_point(
    job: str,
    claim: Claim,
    backend: Backend,
    options: SearchOptions,
    fingerprint_hash: str,
    deadline: float | None,
    store: Store,
    space_cache: dict[tuple[int, ...], SearchSpace] | None = None,
    *,
    model: PerfModel | None = None,
) -> tuple[list[Measurement], list[Entry], list[tuple[int, str]]]:
    """Search one claimed point; returns what to write with its completion.

    Verified configs already stored at the point's key (shape, M, dtype, routing class) under
    this fingerprint, from other traces of the class, are timed in the point's final
    comparison too (as seeds); one slower than FlagGems' choice on this trace beyond the noise
    band is returned for rejection: a config stays verified for a key only while no trace of
    that key contradicts it.
    """
    payload = claim.payload
    point = Point.from_payload(payload)
    shape = point.shape
    replay = Trace.from_payload(payload["replay"], shape.experts)
    synthetic = Trace.from_payload(payload["synthetic"], shape.experts)
    heldout = [Trace.from_payload(t, shape.experts) for t in payload.get("heldout", [])]
    neighbours = [Trace.from_payload(t, shape.experts) for t in payload.get("neighbours", [])]
    classes = [Trace.from_payload(t, shape.experts) for t in payload.get("classes", [])]
    key = (shape.experts, shape.hidden, shape.intermediate, shape.topk)
    cache = space_cache if space_cache is not None else {}
    space = cache.get(key)
    if space is None or space.shape != shape:
        space = SearchSpace(shape, backend.profile())
        cache[key] = space
    prefix = f"{_job_tag(job)}-{_point_tag(claim.key)}-{uuid.uuid4().hex[:6]}"
    incumbents = _incumbents(store, shape, replay.routing_class, fingerprint_hash)
    rows = _with_incumbent_row(store, shape, fingerprint_hash, peer_seeds(store, shape))

    def rin(t: Trace) -> RoutingInput:
        return RoutingInput(t.ids, t.trace_hash, t.routing_class)

    pin = PointInput(
        shape=shape,
        replay=rin(replay),
        synthetic=rin(synthetic),
        seed=int(replay.generator.get("seed") or 0),
        run_prefix=prefix,
        fingerprint_hash=fingerprint_hash,
        peer_seeds=tuple(_dedup_configs([*rows, *incumbents.values()])),
        peer_rows=tuple(rows),
        heldout=tuple(rin(t) for t in heldout),
        neighbours=tuple(rin(t) for t in neighbours),
        classes=tuple(rin(t) for t in classes),
    )
    budget_s = None
    if deadline is not None:
        left = max(0.0, deadline - time.time())
        pending = sum(1 for p in store.points(job) if p.state != "done")
        # the pending points are shared by every worker of the job, measuring in parallel
        workers = max(1, int(os.environ.get("MXDB_TUNE_WORKERS", "1") or 1))
        budget_s = left * min(workers, max(1, pending)) / max(1, pending)
    clock = getattr(backend, "clock", None) if budget_s is None else None
    result: SearchResult = search(
        backend,
        pin,
        options,
        space=space,
        budget_s=budget_s,
        clock=clock or time.monotonic,
        model=model,
    )
    arms = [pointverdict.arm_from_measurement(m) for m in result.measurements if m.comparison]
    decision = pointverdict.decide(arms, heldout_min=options.heldout, rule=pointverdict.RULE)
    entry = point_entry(
        result,
        decision,
        routing_class=replay.routing_class,
        fingerprint_hash=fingerprint_hash,
        device_name=backend.fingerprint().device_name,
    )
    rejections = contradicted(result, incumbents, replay.trace_hash)
    rejections += superseded(store, entry, replay.trace_hash)
    # a split winner cannot go into vLLM's or FlagGems' tables: keep the best single config
    # measured beside it for their exports (status imported: never dispatched)
    single = single_record(
        result,
        decision,
        routing_class=replay.routing_class,
        fingerprint_hash=fingerprint_hash,
        device_name=backend.fingerprint().device_name,
    )
    # every row the point writes names its job (the store's job column)
    entries = [e.model_copy(update={"job": job}) for e in (entry, single) if e is not None]
    measurements = [m.model_copy(update={"job": job}) for m in result.measurements]
    return measurements, entries, rejections


def _with_incumbent_row(
    store: Store, shape: MoEShape, fingerprint_hash: str, rows: list[KernelConfig]
) -> list[KernelConfig]:
    """The peer rows of a point and the incumbent's table row for this device (a shipped vLLM
    table's row, :mod:`mxdb.incumbent`), so that every point is measured against what the
    user runs today: a baseline or parity record then says so of the incumbent too."""
    from mxdb.incumbent import incumbent

    fp = store.get_fingerprint(fingerprint_hash)
    inc = incumbent(shape, fp.device_name if fp is not None else None)
    if not inc.is_table_row or any(r.hash == inc.config.hash for r in rows):
        return rows
    return [*rows, inc.config]


def _dedup_configs(configs: Sequence[KernelConfig]) -> list[KernelConfig]:
    return list({c.hash: c for c in configs}.values())


def _incumbents(
    store: Store, shape: MoEShape, routing_class: str, fingerprint_hash: str
) -> dict[int, KernelConfig]:
    """Verified and parity configs stored at this key (any trace), by entry id: each is timed
    on this point's replay and rejected if slower than FlagGems' choice there."""
    out: dict[int, KernelConfig] = {}
    for e in store.entries(
        op=shape.op,
        dtype=shape.dtype,
        family=shape.family,
        status=["verified", "parity"],
        fingerprint_hash=fingerprint_hash,
    ):
        if e.tokens == shape.tokens and e.routing_class == routing_class and e.id is not None:
            out[e.id] = KernelConfig.parse(e.config)
    return out


def superseded(store: Store, entry: Entry | None, trace_hash: str) -> list[tuple[int, str]]:
    """Earlier tunes' decisions for the same key *and trace* with another config.

    A point tuned again (a later job replaying the same trace, e.g. under a newer decision
    rule) decides its key afresh: the rows an earlier tune stored for that trace with another
    config (a baseline record replaced by a parity record, a verified config by another) are
    returned for rejection, so the key answers the latest tune of its trace.  Only where the
    store holds no replay of another trace at the key: a row may stand for the decisions of
    several traces (routing sources falling in one class) while naming one of them, so with
    other traces measured nothing is superseded.
    """
    if entry is None:
        return []
    others = {
        m.trace_hash
        for m in store.measurements(op=entry.op, family=entry.family, tokens=entry.tokens)
        if m.comparison == "replay"
        and m.role == "baseline"
        and m.dtype == entry.dtype
        and m.routing_class == entry.routing_class
        and m.trace_hash != trace_hash
    }
    if others:
        return []
    out = []
    for e in store.entries(
        op=entry.op,
        dtype=entry.dtype,
        family=entry.family,
        fingerprint_hash=entry.fingerprint_hash,
        source="tune",
        status=DECIDED_STATUSES,
    ):
        if (
            e.id is None
            or e.tokens != entry.tokens
            or e.routing_class != entry.routing_class
            or e.device_name != entry.device_name
            or e.config_hash == entry.config_hash
            or not e.evidence
        ):
            continue
        ms = store.measurements(run_id=e.evidence)
        if ms and ms[0].trace_hash == trace_hash:
            why = f"superseded by a later tune of trace {trace_hash}: "
            out.append((e.id, why + f"{entry.status} {entry.config_hash}"))
    return out


def contradicted(
    result: SearchResult,
    incumbents: dict[int, KernelConfig],
    trace_hash: str,
) -> list[tuple[int, str]]:
    """The incumbents this point's replay comparison found slower than FlagGems' choice.

    Slower is :func:`mxdb.verdict.compare`'s "slower", from the replay comparison's rounds
    (FlagGems' copies against the incumbent's samples).
    """
    copies = [result.baseline_samples, *result.control_samples]
    if not all(copies):
        return []
    finals: dict[str, list[float]] = {}
    margin = 0.0
    for m in result.measurements:
        if m.comparison == "replay" and m.role != "baseline" and m.status == "ok" and m.samples_us:
            finals[m.config_hash] = list(m.samples_us)
            margin = m.margin or 0.0
    out = []
    for entry_id, cfg in sorted(incumbents.items()):
        samples = finals.get(cfg.hash)
        if not samples:
            continue
        v = verdict.compare(copies, samples, margin=margin)
        if v.slower:
            out.append(
                (
                    entry_id,
                    f"slower than FlagGems' choice on trace {trace_hash} of the same key: "
                    f"{v.reason}",
                )
            )
    return out


def _child(
    job: str,
    url: str,
    options: SearchOptions,
    fingerprint_hash: str,
    factory: BackendFactory,
    device: int,
    deadline: float | None,
    lease_s: float,
    workers: int = 1,
    model: PerfModel | None = None,
) -> None:
    # before anything imports torch: this process sees exactly one GPU
    os.environ["CUDA_VISIBLE_DEVICES"] = str(device)
    # the host's cores are shared by every worker's compile pool
    os.environ["MXDB_TUNE_WORKERS"] = str(workers)
    os.environ.setdefault(
        "MXDB_COMPILE_WORKERS", str(max(2, (os.cpu_count() or 2) // max(1, workers) - 1))
    )
    backend: Backend | None = None
    try:
        backend = factory()
        with Store.open(url) as store:
            work(
                job,
                store,
                backend,
                options,
                fingerprint_hash,
                deadline,
                lease_s,
                worker=f"{os.uname().nodename}:gpu{device}:{os.getpid()}",
                model=model,
            )
    except MxdbError as exc:
        print(f"mxdb: worker on device {device}: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None
    finally:
        # a worker process ends with os._exit: nothing closes its compile pool but this
        if backend is not None:
            close_backend(backend)


def _run_processes(
    job: str,
    url: str,
    options: SearchOptions,
    fingerprint_hash: str,
    factory: BackendFactory,
    devices: Sequence[int],
    deadline: float | None,
    lease_s: float,
    progress: bool,
    total: int,
    model: PerfModel | None = None,
) -> int:
    ctx = mp.get_context("spawn")
    common = (job, url, options, fingerprint_hash, factory)
    procs = [
        ctx.Process(
            target=_child,
            args=(*common, d, deadline, lease_s, len(devices), model),
            name=f"mxdb-tune-gpu{d}",
        )
        for d in devices
    ]
    with Store.open(url) as store:
        before = sum(1 for p in store.points(job) if p.state == "done")
        for p in procs:
            p.start()
        bar = _Progress(total, progress, store, job)
        while any(p.is_alive() for p in procs):
            bar.refresh()
            time.sleep(0.3)
        for p in procs:
            p.join()
        bar.refresh()
        bar.close()
        after = sum(1 for p in store.points(job) if p.state == "done")
    failed = [p.name for p in procs if p.exitcode not in (0, None)]
    if failed and after < total:
        print(
            f"mxdb: workers {failed} exited with errors; run tune again to finish", file=sys.stderr
        )
    return after - before


class _Progress:
    """A rich progress bar with ETA on stderr (silent when disabled)."""

    def __init__(self, total: int, enabled: bool, store: Store, job: str) -> None:
        self.store = store
        self.job = job
        self.bar: Any = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(
            TextColumn("tuning"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=False,
        )
        self.bar.start()
        self.task = self.bar.add_task("points", total=total)
        self.refresh()

    def refresh(self) -> None:
        if self.bar is not None:
            done = sum(1 for p in self.store.points(self.job) if p.state == "done")
            self.bar.update(self.task, completed=done)

    def advance(self) -> None:
        self.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


# -- evidence ---------------------------------------------------------------------------------


def _job_measurements(store: Store, job: str, shape: MoEShape, key: str) -> list[Measurement]:
    """The measurements of one point of ``job``: the job's rows (the store's job column) whose
    run ids carry the point's tag."""
    prefix = f"{_job_tag(job)}-{_point_tag(key)}-"
    return [
        m
        # every token count: a point's tokens-M comparisons run at neighbouring counts
        for m in store.measurements(op=shape.op, family=shape.family, job=job)
        if m.run_id.startswith(prefix) and m.dtype == shape.dtype
    ]


def _job_entries(store: Store, job: str, fingerprint_hash: str) -> list[Entry]:
    """The entries ``job`` decided (the store's job column; a row a later job superseded
    belongs to that job), with its single-config records."""
    decided = store.entries(
        fingerprint_hash=fingerprint_hash,
        source="tune",
        # rejected ones too: a later trace of the key contradicted them, but this job's own
        # bundle verified them and its store export says what became of them
        status=[*DECIDED_STATUSES, "rejected"],
        job=job,
    )
    # and the single-config records beside its winners that tables cannot express
    singles = store.entries(
        fingerprint_hash=fingerprint_hash, source=SINGLE_SOURCE, status="imported", job=job
    )
    return sorted([*decided, *singles], key=lambda e: e.id or 0)


_METHOD = {"graph": "cuda_graph_replay", "eager": "eager"}


def _decided_elsewhere(
    store: Store,
    job: str,
    fp: Fingerprint,
    points: Sequence[tuple[Point, Trace, Trace]],
    entries: Sequence[Entry],
) -> list[Entry]:
    """Stored rows the job's points decided that another job's point had decided first.

    The store keeps one row per key and config, with the evidence of the first point that
    decided it; a later job deciding the same key and config writes no row of its own.  Its
    bundle must still export that row (the audit resolves its evidence against the bundle that
    holds it).  The decisions are re-made from the job's stored measurements by the rule they
    were decided under, as the audit re-makes them."""

    def natural(e: Entry) -> tuple[Any, ...]:
        return (e.op, e.family, e.dtype, e.tokens, e.routing_class, e.config_hash)

    have = {natural(e) for e in entries}
    stored: dict[tuple[Any, ...], Entry] = {}
    for e in store.entries(fingerprint_hash=fp.hash, source="tune"):
        stored.setdefault(natural(e), e)
    out: list[Entry] = []
    for p, replay, _ in points:
        ms = [m for m in _job_measurements(store, job, p.shape, p.key) if m.comparison]
        if not ms:
            continue
        arms = [pointverdict.arm_from_measurement(m) for m in ms]
        d = pointverdict.decide(arms, rule=_decision_rule(ms))
        s = p.shape
        key = (s.op, s.family, s.dtype, s.tokens, replay.routing_class, d.config_hash)
        row = stored.get(key)
        if d.status != "none" and key not in have and row is not None:
            out.append(row)
            have.add(key)
    return out


def _decision_rule(ms: Sequence[Measurement]) -> int:
    """The ``mxdb.pointverdict`` rule a point's measurements were decided by (rows written
    before the rule was stored: 1; mixed: the lower)."""
    return min((m.decision_rule or 1) for m in ms) if ms else 1


def record_run(w: Any, m: Measurement, shape: MoEShape, schema_version: str | None) -> None:
    """Write measurement ``m`` (of ``shape``'s family) as a run of bundle writer ``w``."""
    w.record(
        run_id=m.run_id,
        shape=shape.with_tokens(m.tokens),
        routing_class=m.routing_class,
        config=m.config,
        role=m.role,
        status=m.status,
        trace_hash=m.trace_hash,
        seed=m.seed,
        samples_us=m.samples_us or None,
        timing_method=_METHOD.get(m.timing_method or "graph", "cuda_graph_replay"),
        max_abs_err=m.max_abs_err,
        rel_err=m.rel_err,
        error=m.error,
        pair_id=m.run_id.rsplit("-", 1)[0] if m.role == "control" else None,
        fidelity=m.fidelity,
        point=m.point,
        comparison=m.comparison,
        margin=m.margin,
        order_seed=m.order_seed,
        schema_version=schema_version,
    )


def write_bundles(
    store: Store,
    job: str,
    workload: Workload,
    fp: Fingerprint,
    points: Sequence[tuple[Point, Trace, Trace]],
    entries: Sequence[Entry],
    out_dir: Path,
    *,
    extras: Mapping[str, dict[str, list[Trace]]] | None = None,
) -> list[Path]:
    """The job's bundles: one for the whole workload, or one per routing source.

    ``extras``: each point's held-out traces (``validation_traces``) as stored with it; drawn
    again from the workload when not given."""
    entries = [*entries, *_decided_elsewhere(store, job, fp, points, entries)]
    labels = list(dict.fromkeys(p.routing_label for p, _, _ in points))
    if len(labels) <= 1:
        return [write_bundle(store, job, workload, fp, points, entries, out_dir, extras=extras)]
    out = []
    for label in labels:
        sub = [t for t in points if t[0].routing_label == label]
        # by key, not by evidence tag: the store keeps one entry per key and config, so a
        # config that won two points of one class carries the first point's tag only
        keys = {(p.shape.family, p.shape.dtype, p.shape.tokens, r.routing_class) for p, r, _ in sub}
        sub_entries = [e for e in entries if (e.family, e.dtype, e.tokens, e.routing_class) in keys]
        if not any(_job_measurements(store, job, p.shape, p.key) for p, _, _ in sub):
            continue
        out.append(
            write_bundle(
                store, job, workload, fp, sub, sub_entries, out_dir, suffix=label, extras=extras
            )
        )
    return out


def write_bundle(
    store: Store,
    job: str,
    workload: Workload,
    fp: Fingerprint,
    points: Sequence[tuple[Point, Trace, Trace]],
    entries: Sequence[Entry],
    out_dir: Path,
    *,
    suffix: str | None = None,
    extras: Mapping[str, dict[str, list[Trace]]] | None = None,
) -> Path:
    """Assemble the evidence bundle of ``job`` (or of some of its points) under ``out_dir``."""
    from mxdb.evidence.writer import BundleWriter
    from mxdb.interop.export import StoreExport

    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    name = f"{workload.name}-{suffix}" if suffix else workload.name
    root = out_dir / f"{name}-{stamp}-{uuid.uuid4().hex[:4]}"
    w = BundleWriter(
        root, milestone=workload.name, fingerprint=fp, fingerprint_data=environment_data()
    )
    for p, replay, synthetic in points:
        ms = _job_measurements(store, job, p.shape, p.key)
        if not ms:
            continue
        extra = extras[p.key] if extras is not None else validation_traces(workload, p, replay)
        for t in (replay, synthetic, *extra["heldout"], *extra["neighbours"], *extra["classes"]):
            w.add_trace(t.ids, experts=p.shape.experts, generator=t.generator)
        # the run schema names the decision rule of each point (pointverdict.RUN_SCHEMA_OF_RULE)
        by_point: dict[str, list[Measurement]] = {}
        for m in ms:
            if m.point:
                by_point.setdefault(m.point, []).append(m)
        rule_versions = {
            k: pointverdict.RUN_SCHEMA_OF_RULE[_decision_rule(v)] for k, v in by_point.items()
        }
        for m in ms:
            # the bundle holds the replayed comparison and every failure; the synthetic
            # rungs' timings stay in the store
            if m.status == "ok" and m.comparison is None and m.max_abs_err is None:
                continue
            record_run(w, m, p.shape, rule_versions.get(m.point or ""))
    used = {e.fingerprint_hash for e in entries if e.fingerprint_hash}
    w.set_store_export(
        StoreExport(fingerprints={h: fp for h in used if h == fp.hash}, entries=list(entries))
    )
    w.finish(bandwidth_bytes_per_s=None)
    return root
