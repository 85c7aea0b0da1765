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
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from mxdb import verdict as verdict_rule
from mxdb.configs import KernelConfig
from mxdb.errors import MxdbError, UsageError
from mxdb.fingerprint import LIVE_COMPONENTS, diff, mismatches
from mxdb.models import DECIDED_STATUSES, Entry, Fingerprint
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


#: Fingerprint components that only a visible GPU (or its driver) can tell.  A fingerprint with
#: none of them was taken where no GPU was seen (``mxdb fingerprint --offline``, a CPU-only CI
#: job): it cannot judge whether entries measured on a GPU still hold.
GPU_FACTS: tuple[str, ...] = tuple(c for c in LIVE_COMPONENTS if c != "vendor")


def has_gpu_facts(fp: Fingerprint) -> bool:
    """Whether ``fp`` records anything about a GPU (see ``GPU_FACTS``)."""
    return any(getattr(fp, c) is not None for c in GPU_FACTS)


def _key(e: Entry) -> tuple[str, str, str, int, str]:
    return (e.op, e.dtype, e.family, e.tokens, e.routing_class)


def retune_workload(entries: Sequence[Entry], name: str) -> dict[str, Any] | None:
    """A workload (``mxdb.tune.workload`` form) covering the MoE entries' shapes, or None.

    Only ``fused_moe`` entries go into a MoE workload (the others are listed by
    ``decode_cases``).  A workload is a cross product, so with several families it covers a
    superset of the stale keys: every family at every stale token count, dtype and routing.
    """
    moe = [e for e in entries if e.op == "fused_moe"]
    if not moe:
        return None
    models: dict[tuple[int, int, int, int], dict[str, int]] = {}
    tokens: set[int] = set()
    dtypes: list[str] = []
    classes: list[str] = []
    for e in moe:
        d = e.dims
        try:
            dims = (d["experts"], d["hidden"], d["intermediate"], d["topk"])
        except KeyError:  # a damaged row: nothing to re-tune it with
            continue
        models.setdefault(
            dims, {"experts": dims[0], "hidden": dims[1], "intermediate": dims[2], "topk": dims[3]}
        )
        tokens.add(e.tokens)
        if e.dtype not in dtypes and e.dtype in ("bf16", "fp16"):
            dtypes.append(e.dtype)
        if e.routing_class not in classes and e.routing_class in CLASS_ROUTINGS:
            classes.append(e.routing_class)
    if not models:
        return None
    return {
        "name": name,
        "models": [models[k] for k in sorted(models)],
        "tokens": sorted(tokens),
        "dtypes": sorted(dtypes) or ["bf16"],
        "routings": [CLASS_ROUTINGS[c] for c in sorted(classes)] or [CLASS_ROUTINGS["uniform"]],
    }


def decode_cases(entries: Sequence[Entry]) -> list[dict[str, Any]]:
    """The decode-op cases (op, dims, tokens, dtype) among ``entries``, to re-tune; sorted."""
    seen: dict[tuple[Any, ...], dict[str, Any]] = {}
    for e in entries:
        if e.op == "fused_moe":
            continue
        dims = {k: int(v) for k, v in sorted(e.dims.items()) if k != "tokens"}
        key = (e.op, tuple(dims.items()), e.tokens, e.dtype)
        seen.setdefault(key, {"op": e.op, "dims": dims, "tokens": e.tokens, "dtype": e.dtype})
    return [seen[k] for k in sorted(seen)]


def check(
    store: Any,
    current: Fingerprint,
    *,
    policy: str = "strict",
    mark: bool = False,
    workload_out: str | Path | None = None,
) -> dict[str, Any]:
    """Find entries made stale by a changed environment; mark them only when ``mark``.

    Every op kind is checked (MoE configs and decode-op choices alike).  A stored fingerprint
    that records a GPU is not judged by a current fingerprint without GPU facts (see
    ``GPU_FACTS``): it is listed under ``cannot_judge`` and its entries are left alone.  The
    whole report is worked out before anything is written, so a failure leaves the store as
    it was.

    Returns ``{"fingerprint", "policy", "dry_run", "drifted": [{fingerprint_hash, changes,
    breaking, entries}], "cannot_judge": [{fingerprint_hash, device_name, entries, reason}],
    "marked", "would_mark", "already_stale", "workload" | None, "decode_cases",
    "workload_path"}``.
    """
    if policy not in ("strict", "device"):
        raise UsageError(f"fingerprint policy {policy!r} unknown; use strict or device")
    known = store.fingerprints()
    judge_gpu = has_gpu_facts(current)
    drifted: list[dict[str, Any]] = []
    cannot_judge: list[dict[str, Any]] = []
    to_mark: dict[str, list[int]] = {}
    newly: list[Entry] = []
    for h, old in sorted(known.items()):
        if h == current.hash:
            continue
        breaking = mismatches(old, current, policy)
        if not breaking:
            continue
        entries = store.entries(fingerprint_hash=h, status=DECIDED_STATUSES)
        if not judge_gpu and has_gpu_facts(old):
            cannot_judge.append(
                {
                    "fingerprint_hash": h,
                    "device_name": old.device_name,
                    "entries": [e.id for e in entries],
                    "reason": (
                        "the current fingerprint has no GPU facts (device, architecture, "
                        "driver and toolkit absent), so it cannot judge entries measured on "
                        f"{old.device_name or 'a GPU'}; run on the GPU host, or pass a GPU "
                        "fingerprint with --fingerprint"
                    ),
                }
            )
            continue
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
    # Stale keys with no verified entry of this environment still need re-tuning.
    ok_hashes = {h for h, fp in known.items() if not mismatches(fp, current, policy)}
    ok_hashes.add(current.hash)
    covered = {
        _key(e) for e in store.entries(status=DECIDED_STATUSES) if e.fingerprint_hash in ok_hashes
    }
    affected = {e.id: e for e in newly}
    already = 0
    for e in store.entries(status="stale"):
        if e.id in affected:
            continue
        already += 1
        if _key(e) not in covered:
            affected[e.id] = e
    ordered = sorted(affected.values(), key=lambda e: e.id or 0)
    workload = retune_workload(ordered, f"retune-{current.hash}")
    if workload is not None and workload_out is not None:
        from mxdb.tune.workload import parse_workload

        parse_workload(workload, source="re-tune workload")  # it must load back
    marked = 0
    if mark:
        for reason, ids in to_mark.items():
            marked += store.set_status(ids, "stale", reason)
    path = None
    if workload is not None and workload_out is not None:
        from mxdb.fileio import atomic_write_text

        atomic_write_text(Path(workload_out), yaml.safe_dump(workload, sort_keys=False))
        path = str(workload_out)
    return {
        "fingerprint": current.hash,
        "policy": policy,
        "dry_run": not mark,
        "drifted": drifted,
        "cannot_judge": cannot_judge,
        "marked": marked,
        "would_mark": sum(len(v) for v in to_mark.values()),
        "already_stale": already,
        "workload": workload,
        "decode_cases": decode_cases(ordered),
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
    # the MoE backend re-measures MoE configs; decode-op choices are not its to guard
    candidates = [
        e
        for e in store.entries(op="fused_moe", status="verified")
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


# -- re-verification: stale entries re-measured in the current environment ---------------------

#: The source of the entries ``reverify`` writes (one per re-measured stale entry).
REVERIFY_SOURCE = "reverify"


def _verdict_key(e: Entry) -> tuple[str, str, str, int, str, str]:
    return (e.op, e.dtype, e.family, e.tokens, e.routing_class, e.config_hash)


def reverify(
    store: Any,
    backend: Any,
    *,
    decode_backend: Any = None,
    reps: int = 20,
    seed: int = 0,
    entry_ids: Sequence[int] | None = None,
    evidence_out: str | Path | None = None,
) -> dict[str, Any]:
    """Re-measure stale entries in the backend's environment; each is verified again or rejected.

    A stale entry is kept as it is: the record of what held in its old environment.  The
    verdict is a new entry of the same key and config under the current fingerprint (source
    ``reverify``): ``verified`` when the config passes the correctness check and is faster than
    FlagGems' choice by the one verdict rule (``mxdb.verdict``: timed beside three copies of it
    in a random order per round, on the class's synthetic routing); ``baseline`` when the config
    is FlagGems' own choice in this environment; ``rejected`` otherwise, with the reason.  The
    stale entry's reason names the verdict entry.  Every timing is stored as a measurement
    (the evidence; the verdict entry's ``evidence`` names its run), and with ``evidence_out``
    the whole report, raw samples included, is also written as JSON.

    Decode-op entries are re-measured with ``decode_backend`` (all implementations, the
    decode tuner's rule): verified again when their implementation still wins, else rejected
    (and the new winner stored verified).  Without a decode backend they are skipped.
    Entries that already have a verdict in this environment are skipped, so a second run
    measures nothing twice.
    """
    if reps < 1:
        raise UsageError(f"reps must be >= 1, got {reps}")
    current = backend.fingerprint()
    store.put_fingerprint(current)
    done = {
        _verdict_key(e)
        for e in store.entries(fingerprint_hash=current.hash, source=REVERIFY_SOURCE)
    }
    stale = store.entries(status="stale")
    if entry_ids is not None:
        wanted = {int(i) for i in entry_ids}
        missing = sorted(wanted - {int(e.id) for e in stale if e.id is not None})
        if missing:
            raise UsageError(
                f"entries {missing} are not stale; reverify takes stale entries "
                "(mxdb drift check --mark lists and marks them)"
            )
        stale = [e for e in stale if e.id in wanted]
    rows: list[dict[str, Any]] = []
    tag = f"reverify-{current.hash}-{uuid.uuid4().hex[:8]}"
    for e in stale:
        if _verdict_key(e) in done:
            rows.append(_row(e, "skipped", "already re-verified in this environment"))
            continue
        if e.op == "fused_moe":
            row = _reverify_moe(store, backend, current, e, reps=reps, seed=seed, tag=tag)
        elif decode_backend is not None:
            row = _reverify_decode(store, decode_backend, current, e, reps=reps, seed=seed, tag=tag)
        else:
            row = _row(e, "skipped", f"no decode-op backend to re-measure {e.op}")
        rows.append(row)
        done.add(_verdict_key(e))
    counts = {v: sum(1 for r in rows if r["verdict"] == v) for v in VERDICTS}
    report: dict[str, Any] = {
        "fingerprint": current.hash,
        "backend": getattr(backend, "name", type(backend).__name__),
        "run": tag,
        "reps": reps,
        "seed": seed,
        **counts,
        "results": rows,
        "evidence_path": None,
    }
    if evidence_out is not None:
        import json

        from mxdb.fileio import atomic_write_text
        from mxdb.fingerprint import fingerprint_document

        report["evidence_path"] = str(evidence_out)
        doc = {
            "schema": "mxdb.reverify",
            **report,
            "fingerprint_document": fingerprint_document(current),
        }
        atomic_write_text(Path(evidence_out), json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return report


#: The verdicts a re-verification row can have.
VERDICTS = ("verified", "baseline", "rejected", "skipped")


def _row(e: Entry, verdict: str, reason: str, **figures: Any) -> dict[str, Any]:
    return {
        "entry_id": e.id,
        "op": e.op,
        "family": e.family,
        "dtype": e.dtype,
        "tokens": e.tokens,
        "routing_class": e.routing_class,
        "config_hash": e.config_hash,
        "verdict": verdict,
        "reason": reason,
        "new_entry_id": None,
        **figures,
    }


def _median(samples: Sequence[float]) -> float | None:
    return statistics.median(samples) if samples else None


def _reverify_moe(
    store: Any, backend: Any, current: Fingerprint, e: Entry, *, reps: int, seed: int, tag: str
) -> dict[str, Any]:
    from mxdb.evidence.thresholds import passes
    from mxdb.models import Measurement
    from mxdb.routing_gen import generate

    d = e.dims
    try:
        shape = MoEShape(d["experts"], d["hidden"], d["intermediate"], d["topk"], e.tokens, e.dtype)
        config = KernelConfig.parse(e.config)
    except (KeyError, MxdbError, ValueError) as exc:
        return _row(e, "skipped", f"the stored entry cannot be re-measured: {exc}")
    kind, params = _GUARD_ROUTINGS.get(e.routing_class, ("uniform", {}))
    ids = generate(kind, e.tokens, shape.experts, shape.topk, seed, **params)
    baseline = backend.baseline_config(shape)
    is_baseline = config.hash == baseline.hash
    # the config and three copies of FlagGems' choice, interleaved on the same inputs in a
    # random order per round: the one verdict rule (mxdb.verdict) decides
    order = [config, baseline, baseline, baseline]
    timings = backend.time(shape, ids, order, reps=reps, seed=seed, order_seed=seed)
    corr = backend.check(shape, ids, config, seed=seed)
    run = f"{tag}-e{e.id}"
    roles = ("candidate", "baseline", "control", "control")
    names = ("candidate", "baseline", "control-a", "control-b")
    ms = [
        Measurement(
            run_id=f"{run}-{name}",
            op="fused_moe",
            dtype=e.dtype,
            family=e.family,
            dims=dict(e.dims),
            tokens=e.tokens,
            routing_class=e.routing_class,
            seed=seed,
            config=cfg.model_dump(),
            config_hash=cfg.hash,
            role=role,
            fidelity="layer",
            status=t.status,
            error=t.error,
            samples_us=list(t.samples_us),
            median_us=_median(t.samples_us),
            max_abs_err=corr.max_abs_err if role == "candidate" else None,
            rel_err=corr.rel_err if role == "candidate" else None,
            timing_method="graph",
            fingerprint_hash=current.hash,
            order_seed=seed,
        )
        for name, role, cfg, t in zip(names, roles, order, timings, strict=True)
    ]
    store.add_measurements(ms)
    t, *copies = timings
    med, base = _median(t.samples_us), _median(copies[0].samples_us)
    copy_samples = [list(c.samples_us) for c in copies if c.status == "ok" and c.samples_us]
    judged = (
        verdict_rule.compare(copy_samples, list(t.samples_us))
        if len(copy_samples) == len(copies) and t.samples_us
        else None
    )
    speedup = judged.speedup if judged is not None else None
    band = judged.noise_band if judged is not None else None
    figures: dict[str, Any] = {
        "median_us": med,
        "baseline_us": base,
        "speedup": speedup,
        "noise_band": band,
        "max_abs_err": corr.max_abs_err,
        "rel_err": corr.rel_err,
        "samples_us": {n: list(x.samples_us) for n, x in zip(names, timings, strict=True)},
        "evidence": run,
    }
    status: str
    if t.status != "ok" or med is None:
        status, reason = "rejected", f"the config did not run here ({t.status}: {t.error})"
    elif not passes(e.dtype, corr.max_abs_err, corr.rel_err):
        status, reason = "rejected", "the config fails the correctness check here"
    elif is_baseline:
        status, reason = "baseline", "the config is FlagGems' own choice here"
    elif judged is None or speedup is None or band is None:
        status, reason = "rejected", "FlagGems' choice has no timing here: nothing to compare"
    elif judged.faster:
        status, reason = "verified", judged.reason
    else:
        status, reason = "rejected", judged.reason
    verdict = Entry(
        op="fused_moe",
        dtype=e.dtype,
        family=e.family,
        dims=dict(e.dims),
        tokens=e.tokens,
        routing_class=e.routing_class,
        config=config.model_dump(),
        config_hash=config.hash,
        fingerprint_hash=current.hash,
        device_name=current.device_name,
        status=status,
        source=REVERIFY_SOURCE,
        speedup=1.0 if status == "baseline" else speedup,
        noise_band=band,
        median_us=med,
        baseline_us=base,
        evidence=run,
        stale_reason=None if status != "rejected" else reason,
    )
    return _record_verdict(store, current, e, verdict, reason, figures)


def _record_verdict(
    store: Any,
    current: Fingerprint,
    e: Entry,
    verdict: Entry,
    reason: str,
    figures: dict[str, Any],
) -> dict[str, Any]:
    [new_id] = store.add_entries([verdict])
    if e.id is not None:
        store.set_status(
            [int(e.id)],
            "stale",
            f"{e.stale_reason or 'stale'}; re-measured in {current.hash}: "
            f"{verdict.status} as entry {new_id} ({reason})",
        )
    row = _row(e, str(verdict.status), reason, **figures)
    row["new_entry_id"] = new_id
    return row


def _reverify_decode(
    store: Any,
    backend: Any,
    current: Fingerprint,
    e: Entry,
    *,
    reps: int,
    seed: int,
    tag: str,
) -> dict[str, Any]:
    from mxdb.decode_rule import DecodeCase
    from mxdb.tune.decode import _records, measure_case

    try:
        case = DecodeCase(
            e.op, {k: v for k, v in e.dims.items() if k != "tokens"}, e.tokens, e.dtype
        )
    except MxdbError as exc:
        return _row(e, "skipped", f"the stored entry cannot be re-measured: {exc}")
    result = measure_case(backend, case, reps=reps, seed=seed)
    run = f"{tag}-e{e.id}"
    winner_entry, ms = _records(result, current, run)
    store.add_measurements(ms)
    impl = e.config.get("impl")
    figures: dict[str, Any] = {
        "winner": result.winner,
        "speedup": result.speedup,
        "noise_band": result.noise_band,
        "median_us": result.winner_median_us,
        "baseline_us": result.baseline_median_us,
        "evidence": run,
    }
    if result.winner == impl:
        verdict = winner_entry.model_copy(update={"source": REVERIFY_SOURCE})
        return _record_verdict(store, current, e, verdict, result.reason, figures)
    reason = f"{result.winner} wins here, not {impl} ({result.reason})"
    rejected = winner_entry.model_copy(
        update={
            "config": dict(e.config),
            "config_hash": e.config_hash,
            "status": "rejected",
            "source": REVERIFY_SOURCE,
            "speedup": None,
            "median_us": None,
            "stale_reason": reason,
        }
    )
    row = _record_verdict(store, current, e, rejected, reason, figures)
    # the new winner is a verified answer for the key in this environment
    [row["winner_entry_id"]] = store.add_entries(
        [winner_entry.model_copy(update={"source": REVERIFY_SOURCE})]
    )
    return row


# -- entry points for the CLI: open the store, call one function, close --------------------


def run_check(
    db: str | None,
    fingerprint_file: str | Path | None,
    *,
    policy: str = "strict",
    mark: bool = False,
    workload_out: str | Path | None = None,
    offline: bool = False,
) -> dict[str, Any]:
    """``mxdb drift check``: ``check`` on the store at ``db`` against a file or this host.

    "This host" is ``mxdb.hostinfo.host_fingerprint``: the live fingerprint on a GPU host (the
    one the tuner records), the GPU-free one with ``offline`` or on a host without a GPU.
    """
    from mxdb.fingerprint import load_fingerprint
    from mxdb.hostinfo import host_fingerprint
    from mxdb.store import Store

    if fingerprint_file:
        current = load_fingerprint(fingerprint_file)
    else:
        current = host_fingerprint(offline=offline).fingerprint
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
    try:
        with Store.open(db, create=False) as store:
            return guard(store, be, **options)
    finally:
        if isinstance(backend, str):  # made here: shut its compile pool down here
            close = getattr(be, "close", None)
            if callable(close):
                close()


def make_decode_backend(name: str) -> Any:
    """The decode-op measuring backend for ``name``: the GPU's, or None for ``fake``."""
    if name != "gpu":
        return None
    try:
        from mxdb.kernels.decode_backend import DecodeGpuBackend
    except ImportError as exc:
        raise UsageError(
            f"re-measuring decode ops on the GPU needs torch and triton ({exc}); install mxdb[gpu]"
        ) from None
    return DecodeGpuBackend()


def run_reverify(db: str | None, backend: str | Any, **options: Any) -> dict[str, Any]:
    """``mxdb drift reverify``: ``reverify`` on the store at ``db`` with a backend (name or
    object).  The GPU's decode-op backend is made only when stale decode-op entries wait."""
    from mxdb.store import Store

    be = make_backend(backend) if isinstance(backend, str) else backend
    try:
        with Store.open(db) as store:
            if isinstance(backend, str) and "decode_backend" not in options:
                wanted = options.get("entry_ids")
                decode = [
                    e
                    for e in store.entries(status="stale")
                    if e.op != "fused_moe" and (wanted is None or e.id in set(wanted))
                ]
                options["decode_backend"] = make_decode_backend(backend) if decode else None
            return reverify(store, be, **options)
    finally:
        if isinstance(backend, str):  # made here: shut its compile pool down here
            close = getattr(be, "close", None)
            if callable(close):
                close()
