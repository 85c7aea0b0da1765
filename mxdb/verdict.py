"""The one verdict rule: when a config is faster or slower than a baseline beyond the noise.

Every caller that compares timings (the tuner, the audit, the peers benchmark, the drift guard,
reports) asks this module, so "faster", "slower" and "correct" have one definition.

A comparison is timed in **rounds**: in each round every arm (the baseline, its same-config
copies, the candidates) runs once, in an order drawn at random for that round, and sample ``r``
of every arm belongs to round ``r``.  The rule works on those pairs:

- The baseline of a round is the median of its same-config copies in that round (at least two
  copies: the baseline and one or more controls).
- The **speedup** is ``exp(median_r log(base_r / cand_r))``: the median paired ratio, so that
  drift shared by a round (clocks, a neighbour's load) cancels.
- Its **confidence interval** is the distribution-free sign-test interval of that median:
  with ``d_(1) <= ... <= d_(n)`` the sorted log ratios, ``[d_(k), d_(n-k+1)]`` with the largest
  ``k`` such that ``P(Binomial(n, 1/2) <= k - 1) <= (1 - confidence) / 2``.  It is exact,
  deterministic (an auditor recomputes it to the last bit) and needs no model of the noise.
- The **noise band** is the largest ``|speedup - 1|`` between two same-config copies
  (every pair of them), with the same paired statistic.
- **faster** when the interval's lower bound clears ``1 + margin`` and the speedup clears the
  noise band; **slower** when the upper bound is below ``1 - margin`` and ``1 - speedup``
  exceeds the band; otherwise **same** (not distinguishable from the baseline).

The rule's own false-verify rate is measured by :func:`false_verify_rate`: each same-config copy
in turn plays the candidate against the others, and every "faster" is a false verification.

Correctness: a fp16/bf16 result passes when its max abs error and its error relative to the
output's scale are within the dtype's thresholds (:data:`THRESHOLDS`), against a float32
reference of the same layer.

Bundles written before this rule (run schema 1.0) were judged by the earlier rule, which the
audit still applies to them: ``speedup - 1 > noise band`` with a single control pair's
``max/min - 1`` as the band (:func:`legacy_verified`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Literal, NamedTuple

#: Two-sided confidence of the speedup interval.
CONFIDENCE = 0.95
#: Rounds below which no interval at :data:`CONFIDENCE` exists (the sign test needs six).
MIN_ROUNDS = 6
#: Default margin the interval's bound must clear (a workload may state its own).
DEFAULT_MARGIN = 0.0

Outcome = Literal["faster", "slower", "same"]


class Threshold(NamedTuple):
    """The largest accepted absolute and relative errors for one dtype."""

    max_abs: float
    max_rel: float


#: Correctness thresholds, keyed by canonical dtype name.  The absolute ones leave room over a
#: few units in the last place at output magnitudes around 1-8 (fp16 has 10 mantissa bits,
#: bf16 7); the C500 M0 evidence measured 0.0009765625 (fp16) and 0.0078125 (bf16).
THRESHOLDS: dict[str, Threshold] = {
    "fp16": Threshold(max_abs=1e-2, max_rel=1e-2),
    "bf16": Threshold(max_abs=6.25e-2, max_rel=5e-2),
    "fp32": Threshold(max_abs=1e-4, max_rel=1e-5),
}


def passes(dtype: str, max_abs_err: float | None, rel_err: float | None) -> bool:
    """Whether errors measured for ``dtype`` pass its thresholds."""
    t = THRESHOLDS[dtype]
    if max_abs_err is None or rel_err is None:
        return False
    if not (math.isfinite(max_abs_err) and math.isfinite(rel_err)):
        return False
    return 0 <= max_abs_err <= t.max_abs and 0 <= rel_err <= t.max_rel


@dataclass(frozen=True, slots=True)
class Paired:
    """The paired speedup of a candidate over a baseline, with its confidence interval."""

    speedup: float
    low: float
    high: float
    rounds: int


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of one comparison, with every figure that decided it."""

    outcome: Outcome
    speedup: float | None
    low: float | None
    high: float | None
    noise_band: float | None
    margin: float
    rounds: int
    reason: str

    @property
    def faster(self) -> bool:
        return self.outcome == "faster"

    @property
    def slower(self) -> bool:
        return self.outcome == "slower"


def median(xs: Sequence[float]) -> float:
    """The median of a non-empty sequence (the mean of the two middle values for an even count)."""
    s = sorted(xs)
    n = len(s)
    mid = n // 2
    return float(s[mid]) if n % 2 else (s[mid - 1] + s[mid]) / 2.0


def _binom_cdf_half(k: int, n: int) -> float:
    """``P(Binomial(n, 1/2) <= k)``, exactly (integer arithmetic, then one division)."""
    if k < 0:
        return 0.0
    return float(sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def sign_rank(n: int, confidence: float = CONFIDENCE) -> int | None:
    """The order statistic ``k`` of the sign-test interval for ``n`` pairs (None if too few)."""
    alpha = (1.0 - confidence) / 2.0
    k = None
    for cand in range(1, n // 2 + 1):
        if _binom_cdf_half(cand - 1, n) <= alpha:
            k = cand
        else:
            break
    return k


def _valid(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def paired(
    baseline: Sequence[float], candidate: Sequence[float], confidence: float = CONFIDENCE
) -> Paired | None:
    """The paired speedup of ``candidate`` over ``baseline`` (same rounds), or None.

    None when the two sides have different round counts or a sample is not a finite positive
    number.  With fewer than :data:`MIN_ROUNDS` rounds the interval is unbounded.
    """
    n = len(baseline)
    if n == 0 or n != len(candidate):
        return None
    if not all(_valid(b) and _valid(c) for b, c in zip(baseline, candidate, strict=True)):
        return None
    d = sorted(math.log(b / c) for b, c in zip(baseline, candidate, strict=True))
    mid = median(d)
    k = sign_rank(n, confidence)
    if k is None:
        return Paired(math.exp(mid), 0.0, math.inf, n)
    return Paired(math.exp(mid), math.exp(d[k - 1]), math.exp(d[n - k]), n)


def round_baseline(copies: Sequence[Sequence[float]]) -> list[float] | None:
    """Per round, the median of the baseline's same-config copies (None if rounds differ)."""
    if not copies:
        return None
    n = len(copies[0])
    if n == 0 or any(len(c) != n for c in copies):
        return None
    return [median([c[r] for c in copies]) for r in range(n)]


def noise_band(copies: Sequence[Sequence[float]]) -> float | None:
    """The largest ``|speedup - 1|`` between two same-config copies (None for fewer than 2)."""
    if len(copies) < 2:
        return None
    worst = 0.0
    for a, b in combinations(copies, 2):
        p = paired(a, b)
        if p is None:
            return None
        worst = max(worst, abs(p.speedup - 1.0))
    return worst


def compare(
    baseline_copies: Sequence[Sequence[float]],
    candidate: Sequence[float],
    *,
    margin: float = DEFAULT_MARGIN,
    confidence: float = CONFIDENCE,
    band: float | None = None,
) -> Verdict:
    """Judge ``candidate`` against the baseline's same-config copies (see the module doc).

    ``band`` gives the noise band when the baseline side is a single arm whose noise was
    measured elsewhere in the same comparison (a peer's row judged against the band of
    FlagGems' copies); otherwise it comes from the copies.
    """
    if band is None:
        band = noise_band(baseline_copies)
    base = round_baseline(baseline_copies)
    p = paired(base, candidate, confidence) if base is not None else None
    if p is None:
        return Verdict(
            "same", None, None, None, band, margin, len(candidate),
            "no paired rounds: the arms' sample counts differ or a sample is invalid",
        )  # fmt: skip
    if band is None:
        return Verdict(
            "same", p.speedup, p.low, p.high, None, margin, p.rounds,
            "fewer than two same-config copies of the baseline: the noise is unknown",
        )  # fmt: skip
    figures = f"{p.speedup:.4f}x, {confidence:.0%} interval [{p.low:.4f}, {p.high:.4f}]"
    if p.low > 1.0 + margin and p.speedup - 1.0 > band:
        outcome: Outcome = "faster"
        reason = f"faster: {figures} clears 1 + margin {margin:g} and the noise band {band:.4f}"
    elif p.high < 1.0 - margin and 1.0 - p.speedup > band:
        outcome = "slower"
        reason = f"slower: {figures} is below 1 - margin {margin:g} and the noise band {band:.4f}"
    else:
        outcome = "same"
        reason = f"not distinguishable: {figures}, noise band {band:.4f}, margin {margin:g}"
    return Verdict(outcome, p.speedup, p.low, p.high, band, margin, p.rounds, reason)


def false_verify_rate(
    groups: Sequence[Sequence[Sequence[float]]], *, margin: float = DEFAULT_MARGIN
) -> tuple[int, int]:
    """A/A comparisons judged "faster", out of all made: (false verifications, comparisons).

    Each group holds three or more same-config copies timed in one comparison; each copy in turn
    is the candidate and the others are the baseline's copies.
    """
    hits = total = 0
    for copies in groups:
        if len(copies) < 3:
            continue
        for j in range(len(copies)):
            rest = [c for i, c in enumerate(copies) if i != j]
            v = compare(rest, copies[j], margin=margin)
            if v.speedup is None or v.noise_band is None:
                continue
            total += 1
            hits += v.faster
    return hits, total


def legacy_verified(speedup: float | None, band: float | None) -> bool:
    """The rule of run schema 1.0: ``speedup - 1 > noise band`` (one control pair's band)."""
    return speedup is not None and band is not None and speedup - 1.0 > band
