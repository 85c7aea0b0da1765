"""Synthetic routing generators: deterministic, valid, and shaped as documented."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mxdb.errors import UsageError
from mxdb.routing import load_topk
from mxdb.routing_gen import KINDS, generate


@settings(max_examples=50, deadline=None)
@given(
    kind=st.sampled_from(sorted(KINDS)),
    experts=st.integers(1, 70),
    data=st.data(),
)
def test_generated_traces_are_valid_and_deterministic(kind: str, experts: int, data: Any) -> None:
    k = data.draw(st.integers(1, experts))
    m = data.draw(st.integers(1, 50))
    seed = data.draw(st.integers(0, 2**31))
    ids = generate(kind, m, experts, k, seed)
    assert ids.shape == (m, k) and ids.dtype == np.int64
    load_topk(ids, experts=experts, topk=k)  # in range, distinct per row
    np.testing.assert_array_equal(ids, generate(kind, m, experts, k, seed))


def test_seeds_differ() -> None:
    assert not np.array_equal(generate("uniform", 64, 64, 8, 1), generate("uniform", 64, 64, 8, 2))


def test_hot_fraction_is_respected() -> None:
    ids = generate("hot", 20000, 16, 2, seed=0, fraction=0.3, hot_expert=5)
    share = float((ids == 5).any(axis=1).mean())
    assert share == pytest.approx(0.3, abs=0.02)
    assert not (generate("hot", 100, 16, 2, seed=0, fraction=0.0) == 0).any()
    assert (generate("hot", 100, 16, 2, seed=0, fraction=1.0) == 0).any(axis=1).all()


def test_zipf_popularity_decreases_with_rank() -> None:
    ids = generate("zipf", 20000, 16, 2, seed=0, s=1.2)
    counts = np.bincount(ids.ravel(), minlength=16)
    assert counts[0] > counts[1] > counts[3] > counts[7] > counts[15]
    flat = generate("zipf", 20000, 16, 2, seed=0, s=0.0)
    c0 = np.bincount(flat.ravel(), minlength=16)
    assert c0.max() / c0.min() < 1.15


def test_sparse_with_skew_loads_its_active_experts_unevenly() -> None:
    flat = generate("sparse", 4000, 64, 4, seed=3, active=0.25)
    skewed = generate("sparse", 4000, 64, 4, seed=3, active=0.25, s=1.2)
    assert len(np.unique(skewed)) == 16  # still only the active experts
    flat_counts = np.bincount(flat.ravel(), minlength=64)
    counts = np.bincount(skewed.ravel(), minlength=64)
    active = counts[counts > 0]
    assert active.max() / active.min() > 3 * flat_counts.max() / flat_counts[flat_counts > 0].min()
    # s = 0 is the plain sparse generator, draw for draw
    np.testing.assert_array_equal(flat, generate("sparse", 4000, 64, 4, seed=3, s=0.0))


def test_sparse_uses_only_active_experts() -> None:
    ids = generate("sparse", 1000, 64, 4, seed=0, active=0.25)
    assert len(np.unique(ids)) == 16
    assert len(np.unique(generate("sparse", 1000, 64, 8, seed=0, active=0.01))) == 8


@pytest.mark.parametrize(
    ("args", "params", "needle"),
    [
        (("nope", 4, 8, 2), {}, "unknown routing kind"),
        (("uniform", 0, 8, 2), {}, "tokens must be an integer >= 1"),
        (("uniform", 4, 8, 9), {}, "cannot exceed"),
        (("uniform", 4, 8, 0), {}, "topk must be"),
        (("uniform", 4, 8, 2), {"s": 1.0}, "unknown parameters"),
        (("zipf", 4, 8, 2), {"s": -1}, "s must be a number"),
        (("hot", 4, 8, 2), {"fraction": 1.5}, "fraction must be"),
        (("hot", 4, 8, 2), {"hot_expert": 8}, "hot_expert must be"),
        (("sparse", 4, 8, 2), {"active": 0}, "active must be"),
        (("uniform", 4.5, 8, 2), {}, "tokens must be"),
    ],
)
def test_bad_arguments(args: tuple[Any, ...], params: dict[str, Any], needle: str) -> None:
    with pytest.raises(UsageError, match=needle):
        generate(*args, **params)
    with pytest.raises(UsageError, match="seed"):
        generate("uniform", 4, 8, 2, seed=-1)
