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
#: Bounds on a model's trees (:func:`validate`), far above what training writes (the committed
#: forests: 40 trees of at most about 2,100 nodes and 32 levels), so that answering is bounded.
MAX_DEPTH = 128
MAX_NODES = 1 << 16
MAX_TREES = 1024
MAX_TOTAL_NODES = 1 << 20
#: the largest feature count a model may declare
MAX_FEATURES = 4096
TREE_KEYS = ("left", "right", "feature", "threshold", "value")


def _ints(values: list[Any], what: str) -> npt.NDArray[np.int64]:
    if not all(type(v) is int and -(2**62) < v < 2**62 for v in values):
        raise UsageError(f"{what} must be a list of integers")
    return np.asarray(values, dtype=np.int64)


def _floats(values: Any, what: str) -> npt.NDArray[np.float64]:
    if not isinstance(values, list) or not all(type(v) in (int, float) for v in values):
        raise UsageError(f"{what} must be a list of numbers")
    return np.asarray(values, dtype=np.float64)


def _validate_tree(t: Any, n_features: int, where: str) -> int:
    """Check one tree (see :func:`validate`); returns its node count."""
    if not isinstance(t, Mapping) or any(k not in t for k in TREE_KEYS):
        raise UsageError(f"{where} must be an object with the lists {', '.join(TREE_KEYS)}")
    n = len(t["left"]) if isinstance(t["left"], list) else -1
    if not 1 <= n <= MAX_NODES or any(
        not isinstance(t[k], list) or len(t[k]) != n for k in TREE_KEYS
    ):
        raise UsageError(
            f"{where}: its lists {', '.join(TREE_KEYS)} must have one entry per node, "
            f"1 to {MAX_NODES} nodes"
        )
    left, right = _ints(t["left"], f"{where} left"), _ints(t["right"], f"{where} right")
    feature = _ints(t["feature"], f"{where} feature")
    threshold = _floats(t["threshold"], f"{where} threshold")
    value = _floats(t["value"], f"{where} value")
    inner = left != -1
    if not np.isfinite(value).all() or not np.isfinite(threshold[inner]).all():
        raise UsageError(f"{where}: its values and split thresholds must be finite numbers")
    if ((right == -1) != ~inner).any():
        raise UsageError(
            f"{where}: a node has one child (left and right must be both -1 or neither)"
        )
    kids = np.concatenate([left[inner], right[inner]])
    if ((kids < 1) | (kids >= n)).any():
        raise UsageError(f"{where}: a child index is outside 1..{n - 1}")
    if ((feature[inner] < 0) | (feature[inner] >= n_features)).any():
        raise UsageError(f"{where}: a split reads a feature outside 0..{n_features - 1}")
    # Walk down from the root level by level: a tree reaches every node exactly once, within
    # MAX_DEPTH levels (a cycle or a node with two parents reaches one twice).
    seen = np.zeros(n, dtype=bool)
    frontier = np.zeros(1, dtype=np.int64)
    for _ in range(MAX_DEPTH + 1):
        if seen[frontier].any() or np.unique(frontier).size != frontier.size:
            raise UsageError(f"{where}: its nodes do not form a tree (a cycle or a shared node)")
        seen[frontier] = True
        frontier = frontier[inner[frontier]]
        if not frontier.size:
            if not seen.all():
                raise UsageError(f"{where}: a node is not reached from the root")
            return n
        frontier = np.concatenate([left[frontier], right[frontier]])
    raise UsageError(f"{where}: deeper than {MAX_DEPTH} levels")


def validate(model: Any) -> None:
    """Check a plain-data model before it is evaluated: a known kind, a feature count of 1 to
    :data:`MAX_FEATURES`, and for tree kinds 1 to :data:`MAX_TREES` trees of at most
    :data:`MAX_TOTAL_NODES` nodes in all, each a tree (every node reached from the root
    exactly once: no cycle, no shared node) of at most :data:`MAX_NODES` nodes and
    :data:`MAX_DEPTH` levels whose lists hold integers and finite numbers, its splits reading
    existing features.  A :class:`UsageError` names the first problem."""
    if not isinstance(model, Mapping):
        raise UsageError(f"the model is a {type(model).__name__}, not an object")
    kind = model.get("kind")
    if kind not in KINDS:
        raise UsageError(f"unknown model kind {kind!r}; known kinds: {', '.join(KINDS)}")
    nf = model.get("n_features")
    if type(nf) is not int or not 1 <= nf <= MAX_FEATURES:
        raise UsageError(f"n_features must be an integer from 1 to {MAX_FEATURES}, got {nf!r}")
    if kind == "linear":
        coef = _floats(model.get("coef"), "coef")
        if coef.size != nf or not np.isfinite(coef).all():
            raise UsageError(f"coef must be {nf} finite numbers")
        if type(model.get("intercept")) not in (int, float):
            raise UsageError("intercept must be a number")
        return
    if kind == "gbt" and not all(type(model.get(k)) in (int, float) for k in ("init", "rate")):
        raise UsageError("a gbt model needs the numbers init and rate")
    ts = model.get("trees")
    if not isinstance(ts, list) or not 1 <= len(ts) <= MAX_TREES:
        raise UsageError(f"trees must be a list of 1 to {MAX_TREES} trees")
    total = 0
    for i, t in enumerate(ts):
        total += _validate_tree(t, nf, f"tree {i}")
        if total > MAX_TOTAL_NODES:
            raise UsageError(f"the trees hold more than {MAX_TOTAL_NODES} nodes in all")


def _tree(t: Mapping[str, Any], x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    left = np.asarray(t["left"], dtype=np.int64)
    right = np.asarray(t["right"], dtype=np.int64)
    feature = np.asarray(t["feature"], dtype=np.int64)
    threshold = np.asarray(t["threshold"], dtype=np.float64)
    value = np.asarray(t["value"], dtype=np.float64)
    node = np.zeros(x.shape[0], dtype=np.int64)
    rows = np.arange(x.shape[0])
    for _ in range(MAX_DEPTH + 1):  # bounded even for a tree that skipped validate()
        inner = left[node] != -1
        if not inner.any():
            return value[node]
        n = node[inner]
        go_left = x[rows[inner], feature[n]] <= threshold[n]
        node[inner] = np.where(go_left, left[n], right[n])
    raise UsageError(f"a tree is deeper than {MAX_DEPTH} levels (or holds a cycle)")


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
