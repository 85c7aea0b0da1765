"""Routing traces: loading, validation, hashing, features and classes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mxdb.errors import TraceError
from mxdb.models import ROUTING_CLASSES
from mxdb.routing import (
    RoutingFeatures,
    analyze_trace,
    classify,
    features,
    load_topk,
    padding_ratio,
    trace_hash,
)
from mxdb.routing_gen import generate

DATA = Path(__file__).parent / "data" / "traces"
SMALL = [[0, 3], [1, 2], [3, 0], [7, 5], [2, 6]]


@st.composite
def traces(draw: Any) -> tuple[list[list[int]], int]:
    experts = draw(st.integers(1, 40))
    k = draw(st.integers(1, min(experts, 6)))
    m = draw(st.integers(1, 30))
    rows = [
        draw(st.permutations(list(range(experts))))[:k]  # distinct ids per row
        for _ in range(m)
    ]
    return rows, experts


class FakeTensor:
    """Duck-typed tensor: what load_topk needs from a torch tensor."""

    def __init__(self, arr: np.ndarray) -> None:
        self._arr = arr

    def detach(self) -> FakeTensor:
        return self

    def cpu(self) -> FakeTensor:
        return self

    def numpy(self) -> np.ndarray:
        return self._arr


# ---------------------------------------------------------------- loading


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(traces())
def test_every_form_loads_the_same_array_and_hash(tmp_path: Path, trace: Any) -> None:
    rows, experts = trace
    as_list = load_topk(rows, experts=experts)
    assert as_list.dtype == np.int64 and as_list.shape == (len(rows), len(rows[0]))
    assert as_list.flags.c_contiguous
    jpath = tmp_path / "t.json"
    jpath.write_text(json.dumps(rows))
    opath = tmp_path / "o.json"
    opath.write_text(json.dumps({"topk_ids": rows, "experts": experts}))
    npath = tmp_path / "t.npy"
    np.save(npath, np.asarray(rows, dtype=np.int32))
    forms = [
        load_topk(jpath, experts=experts),
        load_topk(str(opath)),
        load_topk(npath, experts=experts),
        load_topk(np.asarray(rows, dtype=np.float32), experts=experts),
        load_topk(FakeTensor(np.asarray(rows, dtype=np.int64)), experts=experts),
        load_topk(tuple(tuple(r) for r in rows), experts=experts),
    ]
    h = trace_hash(as_list, experts)
    for arr in forms:
        np.testing.assert_array_equal(arr, as_list)
        assert trace_hash(arr, experts) == h
    assert trace_hash(rows, experts) == h


def test_recorded_trace_files_agree() -> None:
    arrays = [load_topk(DATA / n, experts=8) for n in ("small_list.json", "small.npy")]
    arrays.append(load_topk(DATA / "small_object.json"))
    for arr in arrays:
        np.testing.assert_array_equal(arr, np.asarray(SMALL))
    assert len({trace_hash(a, 8) for a in arrays}) == 1


def test_trace_hash_depends_on_shape_and_order() -> None:
    flat = [[0, 1, 2, 3]]
    assert trace_hash(flat, 8) != trace_hash([[0, 1], [2, 3]], 8)
    assert trace_hash([[0, 1], [2, 3]], 8) != trace_hash([[1, 0], [2, 3]], 8)
    assert trace_hash(flat, 8) != trace_hash(flat, 16)  # the expert count is part of it
    assert len(trace_hash(flat, 8)) == 16


def test_trace_hash_is_the_evidence_definition() -> None:
    from mxdb.evidence.files import trace_hash as evidence_hash

    ids = [[0, 3], [5, 1], [2, 7]]
    assert trace_hash(ids, 8) == evidence_hash(8, ids)


@pytest.mark.parametrize(
    ("source", "needle"),
    [
        ([], "empty"),
        ([[]], "k = 0"),
        ([0, 1, 2], "1-D"),
        ([[[0, 1]], [[1, 2]]], "3-D"),
        ([[0, 1], [2]], "row 1 has 1 ids but row 0 has 2"),
        ([[0, 1], [2, 1.5]], "row 1, column 1 is 1.5"),
        ([[0, True]], "row 0, column 1 is True"),
        ([[0, "3"]], "row 0, column 1 is '3'"),
        ([[0, 1], [2, 2]], "row 1 names expert 2 twice (columns [0, 1])"),
        ([[0, 1], [2, 8]], "row 1, column 1 is 8: expert ids must be in [0, 8)"),
        ([[0, -1]], "row 0, column 1 is -1"),
        (np.zeros(4, dtype=np.int64), "1-D"),
        (np.zeros((2, 2, 2), dtype=np.int64), "3 dimensions"),
        (np.zeros((0, 2), dtype=np.int64), "empty"),
        (np.array([[0, 1], [2, 3]], dtype=bool), "booleans"),
        (np.array([[0.0, 1.0], [2.0, np.nan]]), "row 1, column 1 is nan"),
        (np.array([["a", "b"]]), "not integer expert ids"),
        ({"topk_ids": [[0]]}, "cannot read a trace from a dict"),
    ],
)
def test_bad_traces_name_the_problem(source: Any, needle: str) -> None:
    with pytest.raises(TraceError) as err:
        load_topk(source, experts=8)
    assert needle in str(err.value)
    assert "expected" in str(err.value) or "trace file" in str(err.value)


def test_expected_topk_is_enforced() -> None:
    with pytest.raises(TraceError, match="k = 2 ids per token but top-k 3"):
        load_topk([[0, 1]], topk=3)
    assert load_topk([[0, 1]], topk=2).shape == (1, 2)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="does not exist"):
        load_topk(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("[[0, 1],")
    with pytest.raises(TraceError, match="not valid JSON"):
        load_topk(bad)
    obj = tmp_path / "obj.json"
    obj.write_text(json.dumps({"rows": [[0]]}))
    with pytest.raises(TraceError, match='without a "topk_ids" \\(or "ids"\\) key'):
        load_topk(obj)
    txt = tmp_path / "t.txt"
    txt.write_text("0 1")
    with pytest.raises(TraceError, match=r"use a \.json or \.npy file"):
        load_topk(txt)
    npy = tmp_path / "broken.npy"
    npy.write_bytes(b"not numpy")
    with pytest.raises(TraceError, match=r"\.npy"):
        load_topk(npy)
    conflict = tmp_path / "c.json"
    conflict.write_text(json.dumps({"topk_ids": [[0]], "experts": 4}))
    with pytest.raises(TraceError, match="experts=4 but 8"):
        load_topk(conflict, experts=8)
    with pytest.raises(TraceError, match=r"in \[0, 4\)"):
        load_topk([[5]], experts=4)


@settings(max_examples=40, deadline=None)
@given(traces(), st.integers(0, 5))
def test_wrong_values_anywhere_are_found(trace: Any, salt: int) -> None:
    rows, experts = trace
    i = salt % len(rows)
    j = salt % len(rows[0])
    bad = [list(r) for r in rows]
    bad[i][j] = experts  # one past the last expert
    with pytest.raises(TraceError, match=f"row {i}, column {j} is {experts}"):
        load_topk(bad, experts=experts)


# ---------------------------------------------------------------- features


def _brute_padding(rows: list[list[int]], experts: int, block: int) -> float:
    counts = [0] * experts
    for r in rows:
        for e in r:
            counts[e] += 1
    padded = 0
    for c in counts:
        slots = 0
        while slots < c:
            slots += block
        padded += slots - c
    return padded / sum(counts)


@settings(max_examples=60, deadline=None)
@given(traces(), st.sampled_from([1, 2, 4, 16, 64]))
def test_features_match_brute_force(trace: Any, block: int) -> None:
    rows, experts = trace
    f = features(rows, experts, align_block=block)
    assert f.padding_ratio == pytest.approx(_brute_padding(rows, experts, block))
    counts = [sum(r.count(e) for r in rows) for e in range(experts)]
    assert f.counts == counts
    total = len(rows) * len(rows[0])
    assert f.max_share == pytest.approx(max(counts) / total)
    assert f.empty_ratio == pytest.approx(counts.count(0) / experts)
    mean = total / experts
    cv = math.sqrt(sum((c - mean) ** 2 for c in counts) / experts) / mean
    assert f.cv == pytest.approx(cv)
    ent = -sum(c / total * math.log(c / total) for c in counts if c)
    assert f.entropy_norm == pytest.approx(ent / math.log(experts) if experts > 1 else 1.0)
    assert 0.0 <= f.entropy_norm <= 1.0 + 1e-12
    assert f.routing_class in ROUTING_CLASSES
    assert classify(f) == f.routing_class
    assert RoutingFeatures(**json.loads(f.to_json())) == f


def test_padding_ratio_examples() -> None:
    assert padding_ratio([1, 0, 16, 17], 16) == pytest.approx((15 + 0 + 0 + 15) / 34)
    assert padding_ratio([0, 0], 16) == 0.0
    assert padding_ratio([5], 1) == 0.0


def test_analyze_trace_file() -> None:
    f = analyze_trace(DATA / "small_object.json", 8, 4)
    assert (f.tokens, f.topk, f.experts, f.align_block) == (5, 2, 8, 4)
    assert f.counts == [2, 1, 2, 2, 0, 1, 1, 1]
    assert f.trace_hash == trace_hash(SMALL, 8)


# ---------------------------------------------------------------- classes


@pytest.mark.parametrize(("experts", "topk"), [(8, 2), (64, 6), (64, 8), (128, 8)])
@pytest.mark.parametrize("tokens", [1, 2, 4, 8, 16, 64, 256, 2048])
def test_uniform_routing_is_uniform_at_every_batch_size(
    experts: int, topk: int, tokens: int
) -> None:
    for seed in range(8):
        ids = generate("uniform", tokens, experts, topk, seed)
        assert features(ids, experts).routing_class == "uniform", (tokens, seed)


def test_decode_batch_over_many_experts_is_not_sparse() -> None:
    # 4 tokens x 8 of 128 experts leave >= 96 experts empty: that is what uniform gives.
    ids = generate("uniform", 4, 128, 8, seed=3)
    f = features(ids, 128)
    assert f.empty_ratio >= 0.75
    assert f.routing_class == "uniform"


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(["uniform", "zipf", "hot", "sparse"]),
    shape=st.sampled_from([(8, 2), (64, 6), (64, 8), (128, 8)]),
    tokens=st.sampled_from([1024, 2048, 4096]),
    seed=st.integers(0, 2**16),
)
def test_generated_kinds_classify_stably_at_large_m(
    kind: str, shape: tuple[int, int], tokens: int, seed: int
) -> None:
    experts, topk = shape
    expected = {"uniform": "uniform", "zipf": "skewed", "hot": "hot", "sparse": "sparse"}[kind]
    ids = generate(kind, tokens, experts, topk, seed)
    assert features(ids, experts).routing_class == expected


def test_small_m_classes() -> None:
    # with few tokens, noise must not look like structure
    assert features([[0, 1]], 8).routing_class == "uniform"
    assert features([[0, 1], [2, 3], [4, 5], [1, 6]], 8).routing_class == "uniform"
    # the same pair for every token is unlikely under uniform routing, even at M=4
    assert features([[0, 1], [0, 1], [0, 1], [0, 1]], 8).routing_class != "uniform"
    # but 64 tokens all on the same two of 64 experts are sparse
    assert features([[0, 1]] * 64, 64).routing_class == "sparse"


def test_hot_needs_one_dominant_expert() -> None:
    hot = generate("hot", 4096, 64, 8, seed=1, fraction=0.6)
    f = features(hot, 64)
    assert f.routing_class == "hot"
    assert f.counts[0] == max(f.counts)
    # a milder hot expert is still hot; an evenly graded popularity is skewed
    assert features(generate("hot", 4096, 64, 8, seed=2, fraction=0.4), 64).routing_class == "hot"
    assert features(generate("zipf", 4096, 64, 8, seed=2, s=0.8), 64).routing_class == "skewed"
