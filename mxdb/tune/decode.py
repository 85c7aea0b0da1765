"""Tune the decode ops: per shape and dtype, which implementation (fused, flaggems, torch) to run.

For each case (an op at one shape, row count and dtype) the backend times every available
implementation on the same inputs, interleaved, with a same-implementation control pair of the
baseline (``torch``, the unfused chain) for the noise band, and checks each one against the
float32 reference.  The rule (the same figures as the MoE tuner's, :mod:`mxdb.tune.verify`):

- a candidate is eligible when it passes the dtype's thresholds
  (:mod:`mxdb.evidence.thresholds`);
- ``speedup = median(torch samples) / median(candidate samples)``;
  ``noise band = max(a, b) / min(a, b) - 1`` for the control pair's medians;
- the winner is the fastest eligible candidate whose ``speedup - 1`` exceeds the noise band;
  when none does (or the band is unknown), the winner is ``torch``.

The winner is stored as a verified :class:`~mxdb.models.Entry` with op name, the OpShape's
family, ``config={"impl": winner}``, under the backend's fingerprint, so the dispatcher answers
``dispatch(OpShape(...), None)`` with it under the same fingerprint and staleness rules as MoE
configs.  Every candidate is stored as a :class:`~mxdb.models.Measurement` (failures too), and
the raw samples can be written as an audited evidence bundle (:mod:`mxdb.evidence.decode`).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from mxdb.configs import config_hash
from mxdb.decode_rule import BASELINE, ROUTING_CLASS, Candidate, DecodeCase, DecodeResult, decide
from mxdb.errors import UsageError
from mxdb.evidence import stats
from mxdb.evidence.thresholds import THRESHOLDS, passes
from mxdb.models import Entry, Fingerprint, Measurement
from mxdb.results import Correctness, Timing
from mxdb.shapes import canonical_dtype

if TYPE_CHECKING:
    from mxdb.store import Store


@runtime_checkable
class DecodeBackend(Protocol):
    """What the decode tuner needs from a measuring device (GPU: ``mxdb.kernels.decode_backend``)."""

    name: str

    def fingerprint(self) -> Fingerprint:
        """The live environment fingerprint."""
        ...

    def impls(self, op: str) -> list[str]:
        """The implementations of ``op`` usable here (always including ``torch``)."""
        ...

    def time(self, case: DecodeCase, impls: Sequence[str], *, reps: int, seed: int) -> list[Timing]:
        """Samples (us per call) of each implementation on the same inputs, interleaved."""
        ...

    def check(self, case: DecodeCase, impl: str, *, seed: int) -> Correctness:
        """The implementation's output against the float32 reference."""
        ...


def measure_case(
    backend: DecodeBackend, case: DecodeCase, *, reps: int = 30, seed: int = 0
) -> DecodeResult:
    """Time and check every implementation of ``case`` and apply the rule."""
    impls = [i for i in backend.impls(case.op) if i != BASELINE]
    order = [BASELINE, BASELINE, *impls]  # baseline, its control twin, then the candidates
    timings = backend.time(case, order, reps=reps, seed=seed)
    if len(timings) != len(order):
        raise UsageError(f"backend {backend.name} returned {len(timings)} timings for {order}")
    cands: list[Candidate] = []
    for i, (impl, t) in enumerate(zip(order, timings, strict=True)):
        role = "baseline" if i == 0 else "control" if i == 1 else "candidate"
        err_abs = err_rel = None
        status = t.status
        error = t.error
        if role != "control":
            corr = backend.check(case, impl, seed=seed)
            err_abs, err_rel = corr.max_abs_err, corr.rel_err
            if status == "ok" and not passes(case.dtype, err_abs, err_rel):
                status, error = "wrong", "outside the dtype's thresholds of the float32 reference"
        cands.append(Candidate(impl, role, status, tuple(t.samples_us), err_abs, err_rel, error))
    base = cands[0]
    if base.status != "ok" or not base.samples_us:
        raise UsageError(
            f"the torch baseline of {case.op} failed ({base.status}: {base.error}); "
            "fix the environment before tuning"
        )
    winner, speedup, band, reason = decide(case.dtype, cands)
    win = next((c for c in cands if c.impl == winner and c.role != "control"), base)
    return DecodeResult(
        case=case,
        winner=winner,
        speedup=speedup,
        noise_band=band,
        winner_median_us=stats.median(win.samples_us),
        baseline_median_us=stats.median(base.samples_us),
        candidates=tuple(cands),
        reason=reason,
    )


def _records(
    result: DecodeResult, fp: Fingerprint, evidence: str | None
) -> tuple[Entry, list[Measurement]]:
    case = result.case
    shape = case.shape()
    dims = {**case.dims, "tokens": case.tokens}
    config = {"impl": result.winner}
    entry = Entry(
        op=case.op,
        dtype=case.dtype,
        family=shape.family,
        dims=dims,
        tokens=case.tokens,
        routing_class=ROUTING_CLASS,
        config=config,
        config_hash=config_hash(config),
        fingerprint_hash=fp.hash,
        device_name=fp.device_name,
        status="verified",
        source="tune",
        speedup=result.speedup,
        noise_band=result.noise_band,
        median_us=result.winner_median_us,
        baseline_us=result.baseline_median_us,
        evidence=evidence,
    )
    ms = []
    tag = uuid.uuid4().hex[:10]
    for i, c in enumerate(result.candidates):
        cfg = {"impl": c.impl}
        status = c.status
        if status == "ok" and c.role == "candidate" and c.impl != result.winner:
            status = "slower"
        ms.append(
            Measurement(
                run_id=f"decode-{case.op}-{tag}-{i}",
                op=case.op,
                dtype=case.dtype,
                family=shape.family,
                dims=dims,
                tokens=case.tokens,
                routing_class=ROUTING_CLASS,
                config=cfg,
                config_hash=config_hash(cfg),
                role=c.role,
                fidelity="layer",
                status=status,
                error=c.error,
                samples_us=list(c.samples_us),
                median_us=stats.median(c.samples_us) if c.samples_us else None,
                p90_us=stats.p90(c.samples_us) if c.samples_us else None,
                max_abs_err=c.max_abs_err,
                rel_err=c.rel_err,
                timing_method="events",
                fingerprint_hash=fp.hash,
            )
        )
    return entry, ms


def tune_decode(
    backend: DecodeBackend,
    cases: Sequence[DecodeCase],
    store: Store | None = None,
    *,
    reps: int = 30,
    seed: int = 0,
    evidence_dir: Path | None = None,
    milestone: str = "decode-ops",
) -> list[DecodeResult]:
    """Measure every case, store the winners (verified entries) and all measurements.

    With ``evidence_dir`` the raw samples are also written as a ``mxdb.decode`` bundle there,
    and the entries name it as their evidence.
    """
    fp = backend.fingerprint()
    results = [measure_case(backend, c, reps=reps, seed=seed) for c in cases]
    evidence = None
    if evidence_dir is not None:
        from mxdb.evidence.decode import case_doc, write_decode_bundle

        write_decode_bundle(
            Path(evidence_dir),
            fingerprint=fp,
            milestone=milestone,
            cases=[case_doc(r) for r in results],
            models=[],
        )
        evidence = Path(evidence_dir).name
    out = []
    for r in results:
        entry, ms = _records(r, fp, evidence)
        out.append(DecodeResult(**{**r.__dict__, "entry": entry, "measurements": tuple(ms)}))
    if store is not None:
        store.put_fingerprint(fp)
        store.add_measurements([m for r in out for m in r.measurements])
        store.add_entries([r.entry for r in out if r.entry is not None])
    return out


def thresholds(dtype: str) -> dict[str, float]:
    """The correctness bounds a decode op must meet for ``dtype`` (``max_abs``, ``max_rel``)."""
    t = THRESHOLDS[canonical_dtype(dtype)]
    return {"max_abs": t.max_abs, "max_rel": t.max_rel}


def to_json(result: DecodeResult) -> dict[str, Any]:
    return {
        "op": result.case.op,
        "dtype": result.case.dtype,
        "dims": dict(result.case.dims),
        "tokens": result.case.tokens,
        "winner": result.winner,
        "speedup": result.speedup,
        "noise_band": result.noise_band,
        "reason": result.reason,
    }
