"""A trained regressor as plain data, evaluated with numpy alone.

Training needs scikit-learn (:mod:`mxdb.costmodel.train`); answering does not: a model file
holds its trees (or its linear coefficients) as arrays, and :func:`predict` walks them.  Three
kinds:

* ``gbt``: gradient-boosted trees, ``init + rate * sum(tree(x))``;
* ``forest``: a random forest, ``mean(tree(x))``;
* ``linear``: ``intercept + coef . x``.

A tree is ``{"left", "right", "feature", "threshold", "value"}``: node ``j`` is a leaf when
``left[j] == -1``; otherwise ``x[feature[j]] <= threshold[j]`` goes left (scikit-learn's rule).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from mxdb.errors import UsageError

KINDS = ("gbt", "forest", "linear")


def _tree(t: Mapping[str, Any], x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    left = np.asarray(t["left"], dtype=np.int64)
    right = np.asarray(t["right"], dtype=np.int64)
    feature = np.asarray(t["feature"], dtype=np.int64)
    threshold = np.asarray(t["threshold"], dtype=np.float64)
    value = np.asarray(t["value"], dtype=np.float64)
    node = np.zeros(x.shape[0], dtype=np.int64)
    rows = np.arange(x.shape[0])
    while True:
        inner = left[node] != -1
        if not inner.any():
            return value[node]
        n = node[inner]
        go_left = x[rows[inner], feature[n]] <= threshold[n]
        node[inner] = np.where(go_left, left[n], right[n])


def _rows(model: Mapping[str, Any], x: Sequence[Sequence[float]] | npt.NDArray[Any]) -> Any:
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[1] != int(model["n_features"]):
        raise UsageError(
            f"the model takes rows of {model['n_features']} features, got an array of shape "
            f"{arr.shape}"
        )
    return arr


def members(model: Mapping[str, Any], x: Sequence[Sequence[float]] | npt.NDArray[Any]) -> Any:
    """Each tree's predictions of a forest (``[trees, rows]``): the ensemble's spread."""
    if model["kind"] != "forest":
        raise UsageError(f"only a forest has members to spread over, not a {model['kind']!r}")
    arr = _rows(model, x)
    return np.asarray([_tree(t, arr) for t in model["trees"]])


def predict(
    model: Mapping[str, Any], x: Sequence[Sequence[float]] | npt.NDArray[Any]
) -> list[float]:
    """The model's predictions for the rows of ``x`` (one feature vector per row)."""
    arr = _rows(model, x)
    kind = model["kind"]
    if kind == "linear":
        coef = np.asarray(model["coef"], dtype=np.float64)
        out = float(model["intercept"]) + arr @ coef
    elif kind == "gbt":
        out = np.full(arr.shape[0], float(model["init"]))
        for t in model["trees"]:
            out = out + float(model["rate"]) * _tree(t, arr)
    elif kind == "forest":
        out = np.mean([_tree(t, arr) for t in model["trees"]], axis=0)
    else:
        raise UsageError(f"unknown model kind {kind!r}; known kinds: {', '.join(KINDS)}")
    return [float(v) for v in out]


def from_sklearn(est: Any, kind: str, n_features: int) -> dict[str, Any]:
    """The plain-data form of a fitted scikit-learn regressor of ``kind``."""

    def tree(t: Any, scale: float = 1.0) -> dict[str, Any]:
        return {
            "left": [int(v) for v in t.children_left],
            "right": [int(v) for v in t.children_right],
            "feature": [max(int(v), 0) for v in t.feature],
            "threshold": [float(v) for v in t.threshold],
            "value": [float(v) * scale for v in t.value[:, 0, 0]],
        }

    if kind == "linear":
        return {
            "kind": kind, "n_features": n_features,
            "coef": [float(v) for v in est.coef_], "intercept": float(est.intercept_),
        }  # fmt: skip
    if kind == "gbt":
        return {
            "kind": kind, "n_features": n_features, "rate": float(est.learning_rate),
            "init": float(est.init_.constant_[0][0]),
            "trees": [tree(e.tree_) for e in est.estimators_[:, 0]],
        }  # fmt: skip
    if kind == "forest":
        return {
            "kind": kind, "n_features": n_features,
            "trees": [tree(e.tree_) for e in est.estimators_],
        }  # fmt: skip
    raise UsageError(f"unknown model kind {kind!r}; known kinds: {', '.join(KINDS)}")
