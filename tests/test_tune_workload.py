"""Workload files: the shipped examples, errors that name the field, round-trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from mxdb.errors import WorkloadError
from mxdb.tune.workload import load_workload, parse_workload

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "workloads"


def test_shipped_examples_load() -> None:
    h200 = load_workload(EXAMPLES / "h200-milestone.yaml")
    assert len(h200.points()) == 2 * 6 * 2 * 2
    c500 = load_workload(EXAMPLES / "c500-m0.yaml")
    assert {(p.shape.tokens, p.shape.experts, p.shape.hidden) for p in c500.points()} == {
        (4, 8, 4096)
    }
    assert len(load_workload(EXAMPLES / "smoke.yaml").points()) == 4


BASE = {"name": "w", "models": ["mixtral-8x7b"], "tokens": [4]}


@pytest.mark.parametrize(
    ("patch", "needle"),
    [
        ({"models": ["nope"]}, "accepted presets: deepseek-v2, deepseek-v2-lite"),
        ({"routings": [{"kind": "gauss"}]}, "accepted kinds: uniform, zipf, hot, sparse, replay"),
        (
            {"routings": [{"kind": "zipf", "s": 1}]},
            "field routings.0.zipf.s: unknown field; accepted fields here: kind, exponent",
        ),
        ({"dtypes": ["int8"]}, "field dtypes: unknown dtype 'int8'; accepted: bf16, fp16"),
        ({"tokens": [0]}, "field tokens"),
        ({"search": {"budget": 3}}, "accepted fields here: budget_minutes"),
        ({"routings": [{"kind": "hot", "expert": 99}]}, "expert 99 does not exist"),
    ],
)
def test_errors_name_the_field(patch: dict[str, object], needle: str) -> None:
    with pytest.raises(WorkloadError) as exc:
        parse_workload({**BASE, **patch})
    assert needle in str(exc.value)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="does not exist"):
        load_workload(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(WorkloadError, match="not valid YAML"):
        load_workload(bad)
    missing = tmp_path / "r.yaml"
    missing.write_text(yaml.safe_dump({**BASE, "routings": [{"kind": "replay", "path": "t.json"}]}))
    wl = load_workload(missing)
    from mxdb.tune.traces import point_traces

    with pytest.raises(WorkloadError, match="does not exist"):
        point_traces(wl, wl.points()[0].shape, 0)


def test_replay_trace_is_read_and_tiled(tmp_path: Path) -> None:
    (tmp_path / "t.json").write_text(json.dumps({"ids": [[0, 1], [2, 3], [4, 5]]}))
    path = tmp_path / "w.json"
    path.write_text(json.dumps({**BASE, "routings": [{"kind": "replay", "path": "t.json"}]}))
    wl = load_workload(path)
    replay, synthetic = __import__("mxdb.tune.traces", fromlist=["x"]).point_traces(
        wl, wl.points()[0].shape, 0
    )
    assert replay.ids.tolist() == [[0, 1], [2, 3], [4, 5], [0, 1]]
    assert replay.generator["kind"] == "captured"
    assert synthetic.ids.shape == (4, 2)


def test_held_out_instances_are_fresh_draws_or_later_windows(tmp_path: Path) -> None:
    from mxdb.tune.traces import heldout_traces, neighbour_traces, point_traces

    rows = [[i % 8, (i + 1) % 8] for i in range(13)]  # M=4: windows 1 and 2, a short third
    (tmp_path / "t.json").write_text(json.dumps({"ids": rows}))
    path = tmp_path / "w.json"
    path.write_text(json.dumps({**BASE, "routings": [{"kind": "replay", "path": "t.json"}]}))
    wl = load_workload(path)
    shape = wl.points()[0].shape
    replay, _ = point_traces(wl, shape, 0)
    held = heldout_traces(wl, shape, 0, replay, 3)
    assert [t.ids.tolist() for t in held] == [rows[4:8], rows[8:12]]  # never the replayed rows
    assert all(t.generator["params"]["window"] == w for t, w in zip(held, (1, 2), strict=True))
    # a generated source: fresh seeds of the same generator, all of the point's class
    gen = tmp_path / "g.json"
    gen.write_text(json.dumps({**BASE, "routings": [{"kind": "uniform"}]}))
    wl = load_workload(gen)
    shape = wl.points()[0].shape
    replay, synthetic = point_traces(wl, shape, 0)
    held = heldout_traces(wl, shape, 0, replay, 3)
    hashes = {t.trace_hash for t in held}
    assert len(hashes) == 3 and not hashes & {replay.trace_hash, synthetic.trace_hash}
    assert {t.routing_class for t in held} == {replay.routing_class}
    assert [t.ids.shape[0] for t in neighbour_traces(wl, shape, 0, replay)] == [3, 6]


routing = st.one_of(
    st.just({"kind": "uniform"}),
    st.builds(lambda e: {"kind": "zipf", "exponent": e}, st.floats(0.1, 5, allow_nan=False)),
    st.builds(
        lambda f, x: {"kind": "hot", "fraction": f, "expert": x},
        st.floats(0.05, 1.0, allow_nan=False),
        st.integers(0, 7),
    ),
)


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.lists(st.integers(1, 4096), min_size=1, max_size=6, unique=True),
    dtypes=st.lists(st.sampled_from(["bf16", "fp16"]), min_size=1, max_size=2, unique=True),
    routings=st.lists(
        routing, min_size=1, max_size=3, unique_by=lambda r: json.dumps(r, sort_keys=True)
    ),
    seed=st.integers(0, 2**32 - 1),
)
def test_yaml_round_trip(
    tokens: list[int], dtypes: list[str], routings: list[dict[str, object]], seed: int
) -> None:
    data = {
        **BASE,
        "models": ["mixtral-8x7b", {"experts": 16, "hidden": 64, "intermediate": 32, "topk": 2}],
        "tokens": tokens,
        "dtypes": dtypes,
        "routings": routings,
        "seed": seed,
    }
    try:
        wl = parse_workload(data)
    except WorkloadError as exc:
        assert "routings repeat" in str(exc)  # e.g. two zipf exponents printing alike
        return
    again = parse_workload(yaml.safe_load(yaml.safe_dump(wl.model_dump(mode="json"))))
    assert again == wl
    assert again.content_hash == wl.content_hash
    assert len(wl.points()) == 2 * len(tokens) * len(dtypes) * len(routings)
    assert len({p.key for p in wl.points()}) == len(wl.points())


@pytest.mark.parametrize(
    ("routing", "field"),
    [
        ({"kind": "zipf", "exponent": 1.2}, "exponent"),
        ({"kind": "hot", "fraction": 0.5, "expert": 0}, "fraction"),
        ({"kind": "sparse", "active": 0.25}, "active"),
    ],
)
def test_held_out_instances_perturb_the_source_within_its_class(
    tmp_path: Path, routing: dict[str, object], field: str
) -> None:
    from mxdb.tune.traces import JITTER, SPARSE_ACTIVE, heldout_traces, point_traces

    path = tmp_path / "w.json"
    doc = {**BASE, "models": ["qwen3-30b-a3b"], "tokens": [128], "routings": [routing]}
    path.write_text(json.dumps(doc))
    wl = load_workload(path)
    shape = wl.points()[0].shape
    replay, _ = point_traces(wl, shape, 0)
    held = heldout_traces(wl, shape, 0, replay, 3)
    assert len(held) == 3 and {t.routing_class for t in held} == {replay.routing_class}
    workload_params = {k: v for k, v in routing.items() if k != "kind"}
    assert held[0].generator["params"] == workload_params
    for t in held[1:]:
        params = t.generator["params"]
        assert params != workload_params
        ratio = params[field] / workload_params[field]  # type: ignore[operator]
        low, high = SPARSE_ACTIVE if field == "active" else JITTER
        assert low - 1e-3 <= ratio <= high + 1e-3 or params[field] in (0.05, 1.0)
    if routing["kind"] == "sparse":
        # skewed load among the active experts: some receive far more tokens than others
        assert any(t.generator["params"]["s"] > 0 for t in held[1:])
    # deterministic: the same workload gives the same instances
    again = heldout_traces(wl, shape, 0, replay, 3)
    assert [t.trace_hash for t in again] == [t.trace_hash for t in held]
