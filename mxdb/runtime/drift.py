"""Drift governance: stale entries after an environment change, and performance guards.

``check`` compares the current fingerprint with every fingerprint in the store.  Verified
entries whose fingerprint no longer matches under the policy (the dispatcher's: ``strict`` or
``device``) are marked ``stale`` (kept for the record, never dispatched), listed by the
components that changed, and collected into a re-tune workload for ``mxdb tune``.

``guard`` re-measures a spread of verified entries of this environment on a backend (the GPU,
or ``FakeBackend`` in tests), each interleaved with FlagGems' own choice on the same inputs, and
flags those whose speedup over that baseline moved beyond a threshold from the recorded one: the
drift no version string shows.  The speedup, not the raw median, is compared because a raw time
also moves with the routing instance (the tokens per expert decide the padded blocks) and with
the machine's state, which move the baseline alike; the raw ratio is reported beside it, and is
the criterion only for entries with no recorded speedup.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from mxdb.configs import KernelConfig
from mxdb.errors import UsageError
from mxdb.fingerprint import diff, mismatches
from mxdb.models import Entry, Fingerprint
from mxdb.shapes import MoEShape

#: The synthetic routing that stands for each routing class in a re-tune workload.
CLASS_ROUTINGS: dict[str, dict[str, Any]] = {
    "uniform": {"kind": "uniform"},
    "skewed": {"kind": "zipf", "exponent": 1.2},
    "hot": {"kind": "hot", "fraction": 0.5, "expert": 0},
    "sparse": {"kind": "zipf", "exponent": 3.0},
}
#: routing_gen parameters for the guard's synthetic routing of each class.
_GUARD_ROUTINGS: dict[str, tuple[str, dict[str, Any]]] = {
    "uniform": ("uniform", {}),
    "skewed": ("zipf", {"s": 1.2}),
    "hot": ("hot", {"fraction": 0.5}),
    "sparse": ("zipf", {"s": 3.0}),
}


def _key(e: Entry) -> tuple[str, str, str, int, str]:
    return (e.op, e.dtype, e.family, e.tokens, e.routing_class)


def retune_workload(entries: Sequence[Entry], name: str) -> dict[str, Any] | None:
    """A workload (``mxdb.tune.workload`` form) covering the entries' shapes, or None if none.

    A workload is a cross product, so with several families it covers a superset of the
    stale keys: every family at every stale token count, dtype and routing.
    """
    if not entries:
        return None
    models: dict[tuple[int, int, int, int], dict[str, int]] = {}
    tokens: set[int] = set()
    dtypes: list[str] = []
    classes: list[str] = []
    for e in entries:
        d = e.dims
        dims = (d["experts"], d["hidden"], d["intermediate"], d["topk"])
        models.setdefault(
            dims, {"experts": dims[0], "hidden": dims[1], "intermediate": dims[2], "topk": dims[3]}
        )
        tokens.add(e.tokens)
        if e.dtype not in dtypes and e.dtype in ("bf16", "fp16"):
            dtypes.append(e.dtype)
        if e.routing_class not in classes and e.routing_class in CLASS_ROUTINGS:
            classes.append(e.routing_class)
    return {
        "name": name,
        "models": [models[k] for k in sorted(models)],
        "tokens": sorted(tokens),
        "dtypes": sorted(dtypes) or ["bf16"],
        "routings": [CLASS_ROUTINGS[c] for c in sorted(classes)] or [CLASS_ROUTINGS["uniform"]],
    }


def check(
    store: Any,
    current: Fingerprint,
    *,
    policy: str = "strict",
    mark: bool = True,
    workload_out: str | Path | None = None,
) -> dict[str, Any]:
    """Find (and mark) entries made stale by a changed environment; see the module docstring.

    Returns ``{"fingerprint", "policy", "drifted": [{fingerprint_hash, changes, breaking,
    entries}], "marked": n, "already_stale": n, "workload": {...} | None, "workload_path"}``.
    """
    if policy not in ("strict", "device"):
        raise UsageError(f"fingerprint policy {policy!r} unknown; use strict or device")
    known = store.fingerprints()
    drifted: list[dict[str, Any]] = []
    to_mark: dict[str, list[int]] = {}
    newly: list[Entry] = []
    for h, old in sorted(known.items()):
        if h == current.hash:
            continue
        breaking = mismatches(old, current, policy)
        if not breaking:
            continue
        entries = store.entries(fingerprint_hash=h, status=["verified", "baseline"])
        changes = diff(old, current)
        drifted.append(
            {
                "fingerprint_hash": h,
                "changes": [c.model_dump() for c in changes],
                "breaking": [c.component for c in breaking],
                "entries": [e.id for e in entries],
            }
        )
        if entries:
            reason = "environment changed (" + "; ".join(c.describe() for c in breaking) + ")"
            to_mark[reason] = [int(e.id) for e in entries if e.id is not None]
            newly.extend(entries)
    marked = 0
    if mark:
        for reason, ids in to_mark.items():
            marked += store.set_status(ids, "stale", reason)
    # Stale keys with no verified entry of this environment still need re-tuning.
    ok_hashes = {h for h, fp in known.items() if not mismatches(fp, current, policy)}
    ok_hashes.add(current.hash)
    covered = {
        _key(e)
        for e in store.entries(status=["verified", "baseline"])
        if e.fingerprint_hash in ok_hashes
    }
    affected = {e.id: e for e in newly}
    already = 0
    for e in store.entries(status="stale"):
        if e.id in affected:
            continue
        already += 1
        if _key(e) not in covered:
            affected[e.id] = e
    workload = retune_workload(
        sorted(affected.values(), key=lambda e: e.id or 0), f"retune-{current.hash}"
    )
    path = None
    if workload is not None and workload_out is not None:
        from mxdb.fileio import atomic_write_text
        from mxdb.tune.workload import parse_workload

        parse_workload(workload, source="re-tune workload")  # it must load back
        atomic_write_text(Path(workload_out), yaml.safe_dump(workload, sort_keys=False))
        path = str(workload_out)
    return {
        "fingerprint": current.hash,
        "policy": policy,
        "drifted": drifted,
        "marked": marked if mark else 0,
        "would_mark": sum(len(v) for v in to_mark.values()),
        "already_stale": already,
        "workload": workload,
        "workload_path": path,
    }


def guard_entries(entries: Sequence[Entry], max_shapes: int) -> list[Entry]:
    """An even spread of at most ``max_shapes`` entries, in (family, dtype, tokens) order."""
    ordered = sorted(entries, key=lambda e: (e.family, e.dtype, e.routing_class, e.tokens, e.id))
    if len(ordered) <= max_shapes:
        return ordered
    step = (len(ordered) - 1) / max(max_shapes - 1, 1)
    return [ordered[round(i * step)] for i in range(max_shapes)]


def guard(
    store: Any,
    backend: Any,
    *,
    threshold: float = 0.05,
    policy: str = "strict",
    max_shapes: int = 16,
    reps: int = 10,
    seed: int = 0,
    mark: bool = False,
) -> dict[str, Any]:
    """Re-measure guard entries on ``backend``; flag speedups that moved beyond ``threshold``.

    A row's ``drift`` is the measured speedup over FlagGems' choice divided by the recorded one
    (or, without a recorded speedup, recorded over measured time): below 1 the entry got slower
    than it was relative to the baseline.  Only verified entries with a recorded median whose
    fingerprint matches the backend's environment are guards.  ``mark`` marks the entries that
    got slower as stale.
    """
    if not threshold > 0:
        raise UsageError(f"guard threshold must be > 0, got {threshold}")
    current = backend.fingerprint()
    fps = store.fingerprints()
    ok = {h for h, fp in fps.items() if not mismatches(fp, current, policy)} | {current.hash}
    candidates = [
        e
        for e in store.entries(status="verified")
        if e.fingerprint_hash in ok and e.median_us and e.median_us > 0
    ]
    chosen = guard_entries(candidates, max_shapes)
    results = [_guard_one(backend, e, threshold=threshold, reps=reps, seed=seed) for e in chosen]
    flagged = [r for r in results if r["flagged"]]
    marked = 0
    if mark:
        slower = [int(r["entry_id"]) for r in flagged if r["status"] != "faster"]
        if slower:
            marked = store.set_status(
                slower, "stale", f"guard: performance moved > {threshold:.0%}"
            )
    return {
        "fingerprint": current.hash,
        "backend": getattr(backend, "name", type(backend).__name__),
        "threshold": threshold,
        "guards": len(results),
        "flagged": len(flagged),
        "marked": marked,
        "results": results,
    }


def _recorded_speedup(e: Entry) -> float | None:
    if e.speedup and e.speedup > 0:
        return float(e.speedup)
    if e.baseline_us and e.median_us:
        return float(e.baseline_us) / float(e.median_us)
    return None


def _guard_one(backend: Any, e: Entry, *, threshold: float, reps: int, seed: int) -> dict[str, Any]:
    """Re-measure one entry with FlagGems' choice interleaved; its guard row."""
    from mxdb.routing_gen import generate

    d = e.dims
    shape = MoEShape(d["experts"], d["hidden"], d["intermediate"], d["topk"], e.tokens, e.dtype)
    kind, params = _GUARD_ROUTINGS.get(e.routing_class, ("uniform", {}))
    ids = generate(kind, e.tokens, shape.experts, shape.topk, seed, **params)
    config = KernelConfig.parse(e.config)
    baseline = backend.baseline_config(shape)
    timings = backend.time(shape, ids, [config, baseline], reps=reps, seed=seed)
    recorded = _recorded_speedup(e)
    row: dict[str, Any] = {
        "entry_id": e.id,
        "family": e.family,
        "dtype": e.dtype,
        "tokens": e.tokens,
        "routing_class": e.routing_class,
        "recorded_us": e.median_us,
        "recorded_speedup": None if recorded is None else round(recorded, 4),
    }
    t, b = timings
    if t.status != "ok" or not t.samples_us:
        row.update(
            status=t.status, measured_us=None, ratio=None, speedup=None, drift=None, flagged=True
        )
        return row
    med = statistics.median(t.samples_us)
    ratio = med / float(e.median_us or 1.0)
    speedup = None
    if b.status == "ok" and b.samples_us:
        speedup = statistics.median(b.samples_us) / med
    # the criterion: the speedup over FlagGems' choice when both are known, else the raw time
    drift = speedup / recorded if speedup is not None and recorded else 1.0 / ratio
    moved = abs(drift - 1.0) > threshold
    row.update(
        status="slower" if moved and drift < 1 else "faster" if moved else "ok",
        measured_us=round(med, 3),
        ratio=round(ratio, 4),
        speedup=None if speedup is None else round(speedup, 4),
        drift=round(drift, 4),
        flagged=moved,
    )
    return row


# -- entry points for the CLI: open the store, call one function, close --------------------


def run_check(
    db: str | None,
    fingerprint_file: str | Path | None,
    *,
    policy: str = "strict",
    mark: bool = True,
    workload_out: str | Path | None = None,
) -> dict[str, Any]:
    """``mxdb drift check``: ``check`` on the store at ``db`` against a file or this host."""
    from mxdb.dispatcher import current_fingerprint
    from mxdb.fingerprint import load_fingerprint
    from mxdb.store import Store

    current = load_fingerprint(fingerprint_file) if fingerprint_file else current_fingerprint()
    with Store.open(db, create=False) as store:  # nothing to check in a store that is not there
        return check(store, current, policy=policy, mark=mark, workload_out=workload_out)


def make_backend(name: str) -> Any:
    """The measuring backend by name: ``gpu`` (mxdb.kernels, imported here) or ``fake``."""
    if name == "fake":
        from mxdb.tune.fake import FakeBackend

        return FakeBackend()
    if name == "gpu":
        try:
            from mxdb.kernels.backend import GpuBackend
        except ImportError as exc:
            raise UsageError(
                f"drift guard on the GPU needs torch, triton and flag_gems ({exc}); "
                "install mxdb[gpu] or pass --backend fake"
            ) from None
        return GpuBackend()
    raise UsageError(f"unknown backend {name!r}; use gpu or fake")


def run_guard(db: str | None, backend: str | Any, **options: Any) -> dict[str, Any]:
    """``mxdb drift guard``: ``guard`` on the store at ``db`` with a backend (name or object)."""
    from mxdb.store import Store

    be = make_backend(backend) if isinstance(backend, str) else backend
    with Store.open(db, create=False) as store:
        return guard(store, be, **options)
