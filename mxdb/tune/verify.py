"""Verification: when a tuned config may be stored as ``verified``.

A config is verified only when it is correct (its layer output within the dtype's thresholds
of the float32 reference, :mod:`mxdb.evidence.thresholds`) AND its speedup over the baseline
(FlagGems' own choice for the same call) exceeds the noise band measured by a same-config
control pair in the same interleaved timings.  Speedup and noise band are the evidence
definitions (:mod:`mxdb.evidence.stats`), so the auditor recomputes exactly these figures:

- ``speedup = median(baseline samples) / median(winner samples)``;
- ``noise band = max(a, b) / min(a, b) - 1`` for the control pair's medians ``a``, ``b``;
- verified when ``speedup - 1 > noise band`` (no control pair, no verification).

A point that timed finalists beside the baseline and verified none is stored as a ``baseline``
record: the key measured, FlagGems' own choice not beaten.
"""

from __future__ import annotations

from dataclasses import dataclass

from mxdb.configs import KernelConfig
from mxdb.evidence import stats
from mxdb.evidence.thresholds import passes
from mxdb.models import Entry, EntryStatus, Measurement
from mxdb.tune.search import SearchResult


@dataclass(frozen=True)
class Verdict:
    """Whether a search's winner is verified, with the figures that decided it."""

    verified: bool
    reason: str
    speedup: float | None
    noise_band: float | None
    winner_median_us: float | None
    baseline_median_us: float | None


def noise_band(a: list[float], b: list[float]) -> float | None:
    """The control pair's noise band, or None when either side has no samples."""
    if not a or not b:
        return None
    return stats.pair_noise(stats.median(a), stats.median(b))


def judge(result: SearchResult) -> Verdict:
    """Apply the verification rule to a search result."""
    band = noise_band(*result.control_samples)
    base = stats.median(result.baseline_samples) if result.baseline_samples else None
    win = stats.median(result.winner_samples) if result.winner_samples else None
    corr = result.correctness
    if result.winner is None or win is None or corr is None:
        return Verdict(False, "no correct candidate other than the baseline", None, band, win, base)
    if not passes(result.shape.dtype, corr.max_abs_err, corr.rel_err):
        return Verdict(False, "the winner fails the correctness check", None, band, win, base)
    if base is None:
        return Verdict(False, "the baseline has no timing", None, band, win, base)
    speedup = stats.speedup(base, win)
    if band is None:
        return Verdict(
            False, "no control pair: the noise band is unknown", speedup, band, win, base
        )
    if speedup - 1.0 > band:
        return Verdict(
            True,
            f"speedup {speedup:.4f}x exceeds the noise band {band:.4f}",
            speedup,
            band,
            win,
            base,
        )
    return Verdict(
        False,
        f"speedup {speedup:.4f}x is within the noise band {band:.4f}",
        speedup,
        band,
        win,
        base,
    )


def verified_entry(
    result: SearchResult,
    verdict: Verdict,
    *,
    routing_class: str,
    fingerprint_hash: str | None,
    device_name: str | None,
    evidence: str | None,
) -> Entry | None:
    """The store entry (status "verified") for a verified winner, else None."""
    if not verdict.verified or result.winner is None:
        return None
    return _point_entry(
        result,
        result.winner,
        "verified",
        routing_class=routing_class,
        fingerprint_hash=fingerprint_hash,
        device_name=device_name,
        speedup=verdict.speedup,
        noise_band=verdict.noise_band,
        median_us=verdict.winner_median_us,
        baseline_us=verdict.baseline_median_us,
        evidence=evidence,
    )


def baseline_record(
    result: SearchResult,
    verdict: Verdict,
    *,
    routing_class: str,
    fingerprint_hash: str | None,
    device_name: str | None,
) -> Entry | None:
    """The ``baseline`` entry of a point where nothing beat FlagGems' choice beyond the noise.

    Only when the point measured what the verdict needs (FlagGems' choice on the replayed
    routing, a control pair, and at least one finalist timed beside them): then the key is
    known to be FlagGems', and the dispatcher answers it with FlagGems' choice instead of a
    neighbouring key's config.
    """
    if verdict.verified or verdict.baseline_median_us is None or verdict.noise_band is None:
        return None
    # a point whose budget ran out before any finalist was timed compared nothing with
    # FlagGems' choice: that is no evidence for it
    if not any(
        m.fidelity == "layer" and m.role == "candidate" and m.samples_us
        for m in result.measurements
    ):
        return None
    run = next(
        (m.run_id for m in result.measurements if m.role == "baseline" and m.status == "ok"),
        None,
    )
    return _point_entry(
        result,
        result.baseline,
        "baseline",
        routing_class=routing_class,
        fingerprint_hash=fingerprint_hash,
        device_name=device_name,
        speedup=1.0,
        noise_band=verdict.noise_band,
        median_us=verdict.baseline_median_us,
        baseline_us=verdict.baseline_median_us,
        evidence=run,
    )


#: The source of a tuner's best single-config record (see ``single_record``).
SINGLE_SOURCE = "tune-single"


def single_record(
    result: SearchResult,
    verdict: Verdict,
    *,
    routing_class: str,
    fingerprint_hash: str | None,
    device_name: str | None,
) -> Entry | None:
    """The best *single* config measured at a point whose verified winner is split.

    vLLM's and FlagGems' tables hold one config for both GEMMs, aligned to its BLOCK_SIZE_M;
    a split winner (two GEMM configs, or another alignment block) cannot be written there, and
    neither half of it was measured alone.  The best such uniform config of the point's final
    comparison (correct, timed on the replayed routing beside FlagGems' choice and the control
    pair) is kept, when it too beats FlagGems' choice beyond the noise band, as an entry of
    status ``imported`` and source ``tune-single``: never dispatched, read by the table
    exports (``mxdb.interop.tables``).  None otherwise: the export then writes the
    baseline's config at that key.
    """
    if not verdict.verified or result.winner is None or verdict.noise_band is None:
        return None
    if not verdict.baseline_median_us:
        return None
    w = result.winner
    if w.gemm1 == w.gemm2 and w.align_block == w.gemm1.block_m:
        return None  # the verified entry is itself a single config
    best: tuple[float, Measurement] | None = None
    for m in result.measurements:
        if m.fidelity != "layer" or m.role != "candidate" or m.status != "ok":
            continue
        if not m.samples_us or m.max_abs_err is None or m.rel_err is None:
            continue
        if not passes(result.shape.dtype, m.max_abs_err, m.rel_err):
            continue
        cfg = KernelConfig.parse(m.config)
        if cfg.gemm1 != cfg.gemm2 or cfg.align_block != cfg.gemm1.block_m:
            continue
        med = stats.median(list(m.samples_us))
        if best is None or med < best[0]:
            best = (med, m)
    if best is None:
        return None
    med, m = best
    speedup = stats.speedup(verdict.baseline_median_us, med)
    if speedup - 1.0 <= verdict.noise_band:
        return None
    entry = _point_entry(
        result,
        KernelConfig.parse(m.config),
        "imported",
        routing_class=routing_class,
        fingerprint_hash=fingerprint_hash,
        device_name=device_name,
        speedup=speedup,
        noise_band=verdict.noise_band,
        median_us=med,
        baseline_us=verdict.baseline_median_us,
        evidence=m.run_id,
    )
    return entry.model_copy(update={"source": SINGLE_SOURCE})


def _point_entry(
    result: SearchResult,
    config: KernelConfig,
    status: EntryStatus,
    *,
    routing_class: str,
    fingerprint_hash: str | None,
    device_name: str | None,
    speedup: float | None,
    noise_band: float | None,
    median_us: float | None,
    baseline_us: float | None,
    evidence: str | None,
) -> Entry:
    s = result.shape
    return Entry(
        op=s.op,
        dtype=s.dtype,
        family=s.family,
        dims=s.dims(),
        tokens=s.tokens,
        routing_class=routing_class,
        config=config.model_dump(),
        config_hash=config.hash,
        fingerprint_hash=fingerprint_hash,
        device_name=device_name,
        status=status,
        source="tune",
        speedup=speedup,
        noise_band=noise_band,
        median_us=median_us,
        baseline_us=baseline_us,
        evidence=evidence,
    )
