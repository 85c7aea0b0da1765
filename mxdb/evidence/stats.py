"""The statistics every evidence figure is derived from, shared by the writer and the auditor.

Definitions (the auditor recomputes every claimed figure with these same functions):

- ``median``: the middle of the sorted samples; the mean of the two middle ones for an even count.
- ``p90``: the 90th percentile with linear interpolation between closest ranks, numpy's default
  (``numpy.percentile(samples, 90)``, method "linear"): ``s[f] + (s[f+1] - s[f]) * frac`` at
  position ``0.9 * (n - 1)``.
- ``speedup``: ``median(baseline) / median(best candidate)``; above 1 means the candidate is faster.
- ``noise_band``: for a same-config control pair (A vs A) with medians ``a`` and ``b``,
  ``max(a, b) / min(a, b) - 1``; for a group with several pairs, the largest of them.
- ``geomean``: ``exp(mean(log(x)))`` over positive values.

Recomputed floats are compared with :data:`REL_TOL` (relative) and :data:`ABS_TOL` (absolute,
for values near zero such as a noise band of 0): evidence files store floats with ``repr``
precision, so a faithful file reproduces them to the last bit and any real edit is far outside.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

#: Relative tolerance of the audit's recomputation of a claimed float.
REL_TOL = 1e-9
#: Absolute tolerance (only matters for values near zero).
ABS_TOL = 1e-12


def median(samples: Sequence[float]) -> float:
    """The median of a non-empty sequence."""
    s = sorted(samples)
    n = len(s)
    if n == 0:
        raise ValueError("median of no samples")
    mid = n // 2
    if n % 2:
        return float(s[mid])
    return (s[mid - 1] + s[mid]) / 2.0


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation (numpy's default method)."""
    s = sorted(samples)
    n = len(s)
    if n == 0:
        raise ValueError("percentile of no samples")
    pos = (q / 100.0) * (n - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    # numpy's _lerp form, so that results agree to the last bit
    a, b = float(s[lo]), float(s[hi])
    diff = b - a
    out = a + diff * frac if frac < 0.5 else b - diff * (1.0 - frac)
    return out


def p90(samples: Sequence[float]) -> float:
    """The 90th percentile, linear interpolation."""
    return percentile(samples, 90.0)


def geomean(values: Iterable[float]) -> float | None:
    """Geometric mean of positive values, ``None`` for none."""
    vals = list(values)
    if not vals:
        return None
    return math.exp(math.fsum(math.log(v) for v in vals) / len(vals))


def speedup(baseline_median: float, candidate_median: float) -> float:
    """How many times faster the candidate is than the baseline."""
    return baseline_median / candidate_median


def pair_noise(median_a: float, median_b: float) -> float:
    """The noise of one same-config control pair: ``max/min - 1`` of its two medians."""
    return max(median_a, median_b) / min(median_a, median_b) - 1.0


def close(claimed: float, recomputed: float) -> bool:
    """Whether a claimed float agrees with its recomputation within the audit's tolerance."""
    return math.isclose(claimed, recomputed, rel_tol=REL_TOL, abs_tol=ABS_TOL)


def valid_sample(x: object) -> bool:
    """A timing sample must be a finite, positive number of microseconds."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
