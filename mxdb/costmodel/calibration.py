"""The map from a predicted speedup to the probability that the config really is faster.

The signal is the forest's *agreement*: the share of its trees that predict the choice faster
than FlagGems' choice by more than the verify margin.  Fitted by Platt scaling (a logistic
regression of "was faster" on the agreement) on leave-one-family-out outcomes, and stored as
its two coefficients; :func:`confidence` needs no scikit-learn.  (An isotonic fit, tried on the
same outcomes, had a held-out calibration error about four times larger: too few outcomes per
breakpoint.)  The calibration error of stated confidences against measured outcomes is the
expected calibration error over :data:`BINS` equal-width bins (:func:`calibration_error`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

#: bins of stated confidence for the calibration error
BINS = 10


def fit(points: Sequence[tuple[float, bool]]) -> dict[str, Any]:
    """Platt scaling: ``P(faster) = 1 / (1 + exp(-(a * agreement + b)))``, fitted by logistic
    regression (scikit-learn's ``LogisticRegression``, its default L2 penalty) on
    (agreement, faster) pairs; a constant at the mean win rate when only one outcome occurs."""
    if not points:
        return {"a": 0.0, "b": -50.0, "n": 0}
    xs = np.asarray([[p[0]] for p in points], dtype=np.float64)
    ys = np.asarray([1 if p[1] else 0 for p in points], dtype=np.int64)
    if len(set(ys.tolist())) < 2:
        rate = float(ys.mean())
        b = 50.0 if rate == 1.0 else -50.0
        return {"a": 0.0, "b": b, "n": len(points)}
    from sklearn.linear_model import LogisticRegression

    lr = LogisticRegression(C=1.0)
    lr.fit(xs, ys)
    return {"a": float(lr.coef_[0][0]), "b": float(lr.intercept_[0]), "n": len(points)}


def confidence(cal: Mapping[str, Any], agreement: float) -> float:
    """The calibrated probability that a choice with this ensemble ``agreement`` is faster."""
    z = float(cal["a"]) * agreement + float(cal["b"])
    return 1.0 / (1.0 + math.exp(-max(min(z, 50.0), -50.0)))


def calibration_error(pairs: Sequence[tuple[float, bool]], bins: int = BINS) -> float | None:
    """Expected calibration error of (stated confidence, won) pairs: over equal-width bins of
    the stated confidence, the count-weighted mean of ``|mean stated - win rate|``."""
    if not pairs:
        return None
    total = 0.0
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        inb = [(c, w) for c, w in pairs if lo <= c < hi or (b == bins - 1 and c == 1.0)]
        if not inb:
            continue
        stated = sum(c for c, _ in inb) / len(inb)
        rate = sum(1.0 for _, w in inb if w) / len(inb)
        total += len(inb) * abs(stated - rate)
    return total / len(pairs)
