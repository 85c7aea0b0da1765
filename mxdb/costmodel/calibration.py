"""The map from a model's choice to the probability that the config really is faster.

Two maps, both Platt scaling (a logistic regression of "was faster" on the choice's signals),
stored as coefficients so that :func:`confidence` needs no scikit-learn:

- on the sweep (:func:`fit`): the forest's *agreement* (the share of its trees that predict
  the choice faster than FlagGems' choice by more than the verify margin), fitted on the
  sweep's leave-one-family-out outcomes.  (An isotonic fit, tried on the same outcomes, had a
  held-out calibration error about four times larger: too few outcomes per breakpoint.)
- on a check (:func:`fit_gated`): the log of the predicted speedup and whether it reaches the
  gate's step, fitted on the measured outcomes of a held-out check of the same
  leave-one-family-out choices (``benchmarks/perf_check.py``).  A win there is a verdict of the
  check's protocol (three copies of FlagGems' choice, eight rounds), which has more power than
  the sweep's: the sweep's outcomes understate the check's win rates, so a map fitted on the
  sweep cannot be calibrated on a check, whatever its inputs.  On the check the win rate rises
  with the predicted speedup and steps up at the gate (near 1 above it); agreement added
  nothing there (held-out log loss, by family).

The calibration error of stated confidences against measured outcomes is the expected
calibration error over :data:`BINS` equal-width bins (:func:`calibration_error`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

#: bins of stated confidence for the calibration error
BINS = 10
#: the inverse L2 penalty of :func:`fit_gated`, on standardized inputs (chosen by held-out log
#: loss, leave one family out, over 0.1, 0.3, 1 and 10 on evidence/h200-perf-check-2)
GATED_C = 0.1


def _constant(ys: np.ndarray, n: int) -> dict[str, Any] | None:
    """The map of outcomes holding one verdict only (or none): a constant."""
    if n == 0:
        return {"a": 0.0, "b": -50.0, "n": 0}
    if len(set(ys.tolist())) < 2:
        return {"a": 0.0, "b": 50.0 if float(ys.mean()) == 1.0 else -50.0, "n": n}
    return None


def fit(points: Sequence[tuple[float, bool]]) -> dict[str, Any]:
    """Platt scaling: ``P(faster) = 1 / (1 + exp(-(a * agreement + b)))``, fitted by logistic
    regression (scikit-learn's ``LogisticRegression``, its default L2 penalty) on
    (agreement, faster) pairs; a constant at the mean win rate when only one outcome occurs."""
    ys = np.asarray([1 if p[1] else 0 for p in points], dtype=np.int64)
    const = _constant(ys, len(points))
    if const is not None:
        return const
    from sklearn.linear_model import LogisticRegression

    xs = np.asarray([[p[0]] for p in points], dtype=np.float64)
    lr = LogisticRegression(C=1.0)
    lr.fit(xs, ys)
    return {"a": float(lr.coef_[0][0]), "b": float(lr.intercept_[0]), "n": len(points)}


def gated_inputs(predicted: float, step: float) -> tuple[float, float]:
    """:func:`fit_gated`'s inputs of one choice: log predicted speedup, and 1.0 when it
    reaches the gate's ``step``."""
    return math.log(predicted), 1.0 if predicted >= step else 0.0


def fit_gated(points: Sequence[tuple[float, bool]], step: float) -> dict[str, Any]:
    """Platt scaling on a check's outcomes: ``P(faster) = 1 / (1 + exp(-(c * log(predicted)
    + d * [predicted >= step] + b)))``, fitted on (predicted speedup, faster) pairs by logistic
    regression on standardized inputs (penalty :data:`GATED_C`), stored unstandardized; an
    input that does not vary gets no coefficient, one verdict only gives a constant."""
    ys = np.asarray([1 if p[1] else 0 for p in points], dtype=np.int64)
    const = _constant(ys, len(points))
    if const is not None:
        return {**const, "c": 0.0, "d": 0.0, "step": step}
    from sklearn.linear_model import LogisticRegression

    xs = np.asarray([gated_inputs(p[0], step) for p in points], dtype=np.float64)
    mu, sd = xs.mean(axis=0), xs.std(axis=0)
    live = sd > 1e-12  # a constant input (every choice on one side of the step) drops out
    coef = np.zeros(2)
    lr = LogisticRegression(C=GATED_C)
    lr.fit((xs[:, live] - mu[live]) / sd[live], ys)
    coef[live] = lr.coef_[0] / sd[live]
    b = float(lr.intercept_[0]) - float(np.dot(coef[live], mu[live]))
    return {"a": 0.0, "b": b, "c": float(coef[0]), "d": float(coef[1]), "step": step,
            "n": len(points)}  # fmt: skip


def confidence(cal: Mapping[str, Any], agreement: float, predicted: float = 1.0) -> float:
    """The calibrated probability that a choice with this ensemble ``agreement`` and
    ``predicted`` speedup is faster (a sweep's map reads the agreement only)."""
    z = float(cal["a"]) * agreement + float(cal["b"])
    if "c" in cal:
        lp, above = gated_inputs(predicted, float(cal["step"]))
        z += float(cal["c"]) * lp + float(cal["d"]) * above
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
