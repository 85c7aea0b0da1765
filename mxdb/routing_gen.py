"""Synthetic routing: deterministic top-k expert ids for tuning workloads and tests.

Every generator draws from ``numpy.random.default_rng(seed)``, so the same
arguments always give the same ids.  Each token's k experts are distinct:
sampling is without replacement, done for all tokens at once with the
Gumbel-top-k trick (the k largest of ``log(weight) + Gumbel noise`` are a
weighted sample without replacement).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
import numpy.typing as npt

from mxdb.errors import UsageError

#: Generator kinds and their parameters (with defaults).
KINDS: dict[str, dict[str, Any]] = {
    "uniform": {},
    "zipf": {"s": 1.2},
    "hot": {"fraction": 0.5, "hot_expert": 0},
    "sparse": {"active": 0.25, "s": 0.0},
    "logits": {"s": 0.0, "hot_bias": 0.0, "hot_expert": 0, "scale": 1.0},
}


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise UsageError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _check_real(name: str, value: Any, low: float, high: float, *, open_low: bool) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    f = float(value) if ok else math.nan
    below = f <= low if open_low else f < low
    if not ok or not math.isfinite(f) or below or f > high:
        bound = f"({low}, {high}]" if open_low else f"[{low}, {high}]"
        raise UsageError(f"{name} must be a number in {bound}, got {value!r}")
    return f


def _top_k(
    logw: npt.NDArray[np.float64], k: int, rng: np.random.Generator
) -> npt.NDArray[np.int64]:
    keys = logw + rng.gumbel(size=logw.shape)
    idx = np.argpartition(-keys, k - 1, axis=1)[:, :k]
    # order each token's experts by key (largest first), like a router's top-k
    order = np.argsort(-np.take_along_axis(keys, idx, axis=1), axis=1, kind="stable")
    return np.take_along_axis(idx, order, axis=1).astype(np.int64)


def generate(
    kind: str, tokens: int, experts: int, topk: int, seed: int = 0, **params: Any
) -> npt.NDArray[np.int64]:
    """Top-k expert ids of shape ``[tokens, topk]`` (int64), distinct within each row.

    Kinds:

    - ``uniform``: each token picks ``topk`` distinct experts uniformly.
    - ``zipf`` (``s``, default 1.2): expert ``r`` (0-based) has popularity
      ``1 / (r + 1)^s``; each token samples ``topk`` experts without replacement
      in proportion to popularity.
    - ``hot`` (``fraction``, default 0.5; ``hot_expert``, default 0): each token
      includes the hot expert with probability ``fraction``; its other slots
      are uniform over the remaining experts.
    - ``sparse`` (``active``, default 0.25; ``s``, default 0): only ``max(topk, round(active *
      experts))`` experts, chosen at random, receive tokens, uniformly; with ``s`` > 0 the
      active experts have Zipf popularity ``1 / (r + 1)^s`` in a random order.
    - ``logits`` (``s``, ``hot_bias``, ``hot_expert``, ``scale``): a router's view: each token
      has logits ``scale * N(0, 1) + bias`` and takes its ``topk`` largest (the top-k of their
      softmax).  The bias is a Zipf popularity ``-s * log(rank + 1)`` over a seeded random
      ranking of the experts, plus ``hot_bias`` on ``hot_expert``.  A generator of its own,
      so its instances are held out from workloads tuned on the other kinds.
    """
    if kind not in KINDS:
        raise UsageError(f"unknown routing kind {kind!r}; known kinds: {', '.join(KINDS)}")
    unknown = sorted(set(params) - set(KINDS[kind]))
    if unknown:
        allowed = ", ".join(KINDS[kind]) or "none"
        raise UsageError(
            f"unknown parameters {unknown} for routing kind {kind!r}; allowed: {allowed}"
        )
    m = _check_int("tokens", tokens, 1)
    e = _check_int("experts", experts, 1)
    k = _check_int("topk", topk, 1)
    if k > e:
        raise UsageError(f"topk ({k}) cannot exceed the number of experts ({e})")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise UsageError(f"seed must be a non-negative integer, got {seed!r}")
    rng = np.random.default_rng(int(seed))
    opts = {**KINDS[kind], **params}

    if kind == "uniform":
        return _top_k(np.zeros((m, e)), k, rng)

    if kind == "zipf":
        s = _check_real("s", opts["s"], 0.0, 100.0, open_low=False)
        logw = -s * np.log(np.arange(1, e + 1, dtype=np.float64))
        return _top_k(np.broadcast_to(logw, (m, e)).copy(), k, rng)

    if kind == "hot":
        frac = _check_real("fraction", opts["fraction"], 0.0, 1.0, open_low=False)
        hot = opts["hot_expert"]
        if isinstance(hot, bool) or not isinstance(hot, numbers.Integral) or not 0 <= hot < e:
            raise UsageError(f"hot_expert must be an expert id in [0, {e}), got {hot!r}")
        hot = int(hot)
        if e == 1:
            return np.zeros((m, 1), dtype=np.int64)
        others = np.array([x for x in range(e) if x != hot], dtype=np.int64)
        if k == e:  # every token takes every expert, the hot one first
            return np.tile(np.concatenate(([hot], others)), (m, 1)).astype(np.int64)
        with_hot = rng.random(m) < frac
        picks = others[_top_k(np.zeros((m, e - 1)), k, rng)]
        # tokens with the hot expert take it first, then k - 1 of the others
        out = picks.copy()
        out[with_hot, 1:] = picks[with_hot, : k - 1]
        out[with_hot, 0] = hot
        return out

    if kind == "logits":
        zs = _check_real("s", opts["s"], 0.0, 100.0, open_low=False)
        hb = _check_real("hot_bias", opts["hot_bias"], 0.0, 100.0, open_low=False)
        scale = _check_real("scale", opts["scale"], 0.0, 100.0, open_low=True)
        hot = opts["hot_expert"]
        if isinstance(hot, bool) or not isinstance(hot, numbers.Integral) or not 0 <= hot < e:
            raise UsageError(f"hot_expert must be an expert id in [0, {e}), got {hot!r}")
        rank = rng.permutation(e)
        bias = -zs * np.log(rank.astype(np.float64) + 1.0)
        bias[int(hot)] += hb
        logits = scale * rng.standard_normal((m, e)) + bias
        idx = np.argpartition(-logits, k - 1, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(logits, idx, axis=1), axis=1, kind="stable")
        return np.take_along_axis(idx, order, axis=1).astype(np.int64)

    # sparse
    active = _check_real("active", opts["active"], 0.0, 1.0, open_low=True)
    n_active = min(e, max(k, round(active * e)))
    zs = _check_real("s", opts["s"], 0.0, 100.0, open_low=False)
    chosen = np.sort(rng.choice(e, size=n_active, replace=False)).astype(np.int64)
    if zs == 0.0:
        return chosen[_top_k(np.zeros((m, n_active)), k, rng)]
    logw = -zs * np.log(rng.permutation(n_active).astype(np.float64) + 1.0)
    return chosen[_top_k(np.broadcast_to(logw, (m, n_active)).copy(), k, rng)]
