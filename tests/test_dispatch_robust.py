"""Dispatch never hangs and never raises on what a store or a model file holds: malformed model
files are refused once, when loaded; a store that cannot be read, or a row that cannot be, is a
fallback with its reason.  Against real SQLite files and model files in ``tmp_path``."""

from __future__ import annotations

import copy
import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mxdb
import mxdb.dispatcher as dispatcher_module
from mxdb import Dispatcher, DispatchOptions
from mxdb.costmodel import trees
from mxdb.costmodel.model import PerfModel
from mxdb.errors import UsageError
from mxdb.fingerprint import fingerprint_document
from mxdb.shapes import preset_shape
from mxdb.store import Store
from tests.test_dispatch_predicted import NEW, model_doc, write_model
from tests.test_dispatcher import H200, SHAPE, entry

ROOT = Path(__file__).resolve().parents[1]
#: what one call may take, even on a shared machine (a call answers in microseconds)
BOUND_S = 1.0


def tree(left: list[int], right: list[int]) -> dict[str, list[Any]]:
    n = len(left)
    return {"left": left, "right": right, "feature": [0] * n, "threshold": [0.0] * n,
            "value": [0.0] * n}  # fmt: skip


def chain(depth: int) -> dict[str, list[Any]]:
    """A tree whose inner nodes form one path ``depth`` levels long (each with a leaf on its
    right): evaluating a row that always goes left visits every level."""
    n = 2 * depth + 1
    left = [i + 2 if i % 2 == 0 and i < n - 1 else -1 for i in range(n)]
    right = [i + 1 if i % 2 == 0 and i < n - 1 else -1 for i in range(n)]
    t = tree(left, right)
    t["threshold"] = [1e9] * n
    return t


#: a cycle below the root: 1 -> 3 -> 1 (each node has two children, every index in range)
CYCLE = tree([1, 3, -1, 1, -1], [2, 4, -1, 4, -1])


def with_trees(*ts: Any) -> dict[str, Any]:
    """The trained model's document with ``ts`` in front of its trees."""
    doc = copy.deepcopy(model_doc())
    doc["model"]["trees"] = [*ts, *doc["model"]["trees"]]
    return doc


def bounded(fn: Any, *args: Any) -> Any:
    """``fn(*args)``, interrupted with a TimeoutError past :data:`BOUND_S` (a hang fails the
    test rather than hanging it)."""

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"{getattr(fn, '__name__', fn)} did not return within {BOUND_S} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, BOUND_S)
    try:
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture()
def default_dispatcher(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """A fresh process-wide dispatcher (opened by the next mxdb.dispatch), on the H200's
    fingerprint; the previous one is put back afterwards."""
    fp = tmp_path / "fingerprint.json"
    fp.write_text(json.dumps(fingerprint_document(H200)))
    monkeypatch.setenv("MXDB_FINGERPRINT", str(fp))
    monkeypatch.setattr(dispatcher_module, "_default", None)
    yield
    if dispatcher_module._default is not None:
        dispatcher_module._default.close()


# -- model files: checked once, when loaded ---------------------------------------------------


@pytest.mark.parametrize(
    ("name", "bad", "problem"),
    [
        ("cycle", CYCLE, "cycle"),
        ("shared", tree([1, -1, -1], [1, -1, -1]), "shared node"),
        ("deep", chain(trees.MAX_DEPTH + 1), f"deeper than {trees.MAX_DEPTH}"),
        ("one-child", tree([1, -1], [-1, -1]), "one child"),
        ("out-of-range", tree([1, -1], [7, -1]), "child index"),
        ("feature", {**tree([1, -1, -1], [2, -1, -1]), "feature": [99, 0, 0]}, "feature"),
        ("nan", {**tree([-1], [-1]), "value": [float("nan")]}, "finite"),
        ("text", {**tree([-1], [-1]), "left": ["x"]}, "integers"),
        ("not-a-tree", [1, 2], "must be an object"),
    ],
)
def test_a_malformed_tree_is_refused_when_loaded_naming_the_path(
    tmp_path: Path, name: str, bad: Any, problem: str
) -> None:
    path = write_model(tmp_path / name, doc=with_trees(bad))
    with pytest.raises(UsageError) as exc:
        DispatchOptions(model=path)
    assert str(path) in str(exc.value) and problem in str(exc.value), exc.value


def test_a_tree_of_the_largest_depth_loads_and_answers_within_the_bound() -> None:
    model = PerfModel.from_doc(with_trees(chain(trees.MAX_DEPTH)), "deepest")
    disp = Dispatcher(None, H200, DispatchOptions(model=model, refresh_interval=0))
    decision = bounded(disp.dispatch, NEW, "uniform")
    assert decision.reason in {"predicted", "prediction_not_confident"}


def test_a_model_of_another_kind_loads_but_is_not_a_dispatchers(tmp_path: Path) -> None:
    doc = model_doc()
    doc["model"] = {"kind": "linear", "n_features": doc["model"]["n_features"],
                    "coef": [0.0] * doc["model"]["n_features"], "intercept": 0.0}  # fmt: skip
    path = write_model(tmp_path / "linear", doc=doc)
    assert PerfModel.load(path).forest["kind"] == "linear"  # the tuner's order takes any kind
    with pytest.raises(UsageError, match="answering needs a 'forest'") as exc:
        DispatchOptions(model=path)
    assert str(path) in str(exc.value)


def test_a_million_node_chain_is_refused_when_loaded(tmp_path: Path) -> None:
    n = 1_000_000
    big = tree([i + 1 for i in range(n - 1)] + [-1], [n - 1] * (n - 1) + [-1])
    path = write_model(tmp_path / "chain", doc=with_trees(big))
    with pytest.raises(UsageError, match=f"1 to {trees.MAX_NODES} nodes"):
        DispatchOptions(model=path)


def test_a_model_file_holding_a_list_is_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "model.json"
    path.write_text("[1, 2, 3]")
    with pytest.raises(UsageError, match="holds a list, not an object") as exc:
        DispatchOptions(model=path)
    assert str(path) in str(exc.value)


def test_the_committed_models_pass_the_checks() -> None:
    paths = sorted(ROOT.glob("evidence/*/model.json")) + sorted(
        ROOT.glob("evidence/*/perf_model/model.json")
    )
    assert paths
    for path in paths:
        model = PerfModel.load(path)
        assert sum(len(t["left"]) for t in model.forest["trees"]) <= trees.MAX_TOTAL_NODES


def test_a_cyclic_model_given_to_the_cli_is_a_usage_error(tmp_path: Path) -> None:
    path = write_model(tmp_path / "cycle", doc=with_trees(CYCLE))
    db = f"sqlite:///{tmp_path / 'mxdb.sqlite'}"
    Store.open(db).close()
    args = ["-E", "32", "-H", "2880", "-I", "2880", "-k", "4", "-M", "4"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for how in (["--perf-model", str(path)], []):
        res = subprocess.run(
            [sys.executable, "-m", "mxdb", "dispatch", *args, "--db", db, *how],
            capture_output=True, text=True, timeout=60,
            env={**env, "MXDB_MODEL": str(path)} if not how else env,
        )  # fmt: skip
        assert res.returncode == 2, res.stdout + res.stderr
        assert str(path) in res.stderr and "cycle" in res.stderr


# generated trees: small, with any child indices (cycles, shared nodes, out of range), any
# features and thresholds (NaN, infinities), or not trees at all
_INDEX = st.integers(-3, 12)
_NUMBER = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-5, 5)
_TREE = st.integers(1, 10).flatmap(
    lambda n: st.fixed_dictionaries({
        "left": st.lists(_INDEX, min_size=n, max_size=n),
        "right": st.lists(_INDEX, min_size=n, max_size=n),
        "feature": st.lists(st.integers(-2, 50), min_size=n, max_size=n),
        "threshold": st.lists(_NUMBER, min_size=n, max_size=n),
        "value": st.lists(_NUMBER, min_size=n, max_size=n),
    })
)  # fmt: skip
_ANY_TREE = _TREE | st.dictionaries(st.sampled_from(trees.TREE_KEYS), _INDEX | st.text()) | _NUMBER


@settings(max_examples=150, deadline=None)
@given(st.lists(_ANY_TREE, min_size=1, max_size=3))
def test_dispatch_with_any_generated_forest_returns_within_a_bound(ts: list[Any]) -> None:
    doc = model_doc()
    doc = {**doc, "model": {**doc["model"], "trees": ts}}
    start = time.perf_counter()
    try:
        model = bounded(PerfModel.from_doc, doc, "generated")
    except UsageError:
        return  # refused when loaded: never asked
    disp = Dispatcher(None, H200, DispatchOptions(model=model, refresh_interval=0))
    for routing in ("uniform", "hot"):
        decision = bounded(disp.dispatch, NEW, routing)
        assert decision.reason in {"predicted", "prediction_not_confident", "model_error"}
    assert time.perf_counter() - start < 2 * BOUND_S


# -- $MXDB_MODEL: a model that cannot be loaded is a fallback, not an exception ---------------


@pytest.mark.parametrize("what", ["missing", "list", "cycle"])
def test_an_unloadable_mxdb_model_answers_model_unavailable_and_warns(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    default_dispatcher: None,
    what: str,
) -> None:
    db = tmp_path / "mxdb.sqlite"
    with Store.open(f"sqlite:///{db}") as store:
        store.put_fingerprint(H200)
        store.add_entries([entry()])
    bad = write_model(tmp_path / "cycle", doc=with_trees(CYCLE))
    if what == "list":
        bad.write_text("[]")
    elif what == "missing":
        bad = tmp_path / "missing" / "model.json"
    monkeypatch.setenv("MXDB_DB", f"sqlite:///{db}")
    monkeypatch.setenv("MXDB_MODEL", str(bad))
    with caplog.at_level(logging.WARNING, logger="mxdb.dispatcher"):
        decision = bounded(mxdb.dispatch, NEW, "uniform")
    assert (decision.is_fallback, decision.reason) == (True, "model_unavailable")
    assert any(str(bad) in r.getMessage() and "$MXDB_MODEL" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    # the store still answers what it measured, and a non-bf16 call is never the model's
    assert mxdb.dispatch(SHAPE, "uniform").reason == "exact_match"
    assert mxdb.dispatch(preset_shape("gpt-oss-20b", 4, "fp16"), "uniform").reason == "no_entry"
    # given explicitly, the same file is the caller's error
    with pytest.raises(UsageError) as exc:
        DispatchOptions(model=bad)
    assert str(bad) in str(exc.value)


# -- store rows and stores that cannot be read --------------------------------------------------


@pytest.fixture()
def db(tmp_path: Path) -> Path:
    path = tmp_path / "mxdb.sqlite"
    with Store.open(f"sqlite:///{path}") as store:
        store.put_fingerprint(H200)
        store.add_entries([entry(), entry(SHAPE.with_tokens(64))])
    return path


class UnhashableRouting:
    """Routing features the dispatcher answers without caching."""

    routing_class = "uniform"
    __hash__ = None  # type: ignore[assignment]


def sync(db: Path) -> Dispatcher:
    return Dispatcher(Store.open(f"sqlite:///{db}"), H200, DispatchOptions(refresh_interval=0))


@pytest.mark.parametrize("tokens", ["four", 4.5, b"\x04"])
def test_a_row_whose_token_count_is_not_an_integer_is_invalid_entry(
    db: Path, tokens: object
) -> None:
    with sqlite3.connect(db) as conn:  # a row edited behind mxdb's back
        conn.execute("UPDATE entries SET tokens = ? WHERE tokens = 4", (tokens,))
    d = sync(db)
    assert d.dispatch(SHAPE, "uniform").reason == "tokens_out_of_range"  # only 64 is near
    assert d.dispatch(SHAPE.with_tokens(64), "uniform").reason == "exact_match"
    assert [a.reason for a in d.alternatives(SHAPE.with_tokens(64), "uniform")] == ["exact_match"]
    with sqlite3.connect(db) as conn:
        conn.execute("DELETE FROM entries WHERE tokens = 64")
    d = sync(db)
    decision = d.dispatch(SHAPE, "uniform")
    assert (decision.is_fallback, decision.reason) == (True, "invalid_entry")


def test_an_overwritten_store_file_is_store_error(db: Path) -> None:
    d = sync(db)
    db.write_bytes(b"\x00garbage" * 4096)
    for side in db.parent.glob(db.name + "-*"):  # its WAL and shared-memory files
        side.unlink()
    assert d.store is not None
    d.store.close()  # the next read opens a connection on what the file now holds
    decision = d.dispatch(SHAPE, "uniform")
    assert (decision.is_fallback, decision.reason) == (True, "store_error")
    assert d.resolve(SHAPE, "hot").reason == "store_error"


@pytest.mark.parametrize("interval", [0.0, 0.05])
def test_a_dropped_table_is_store_error_until_it_is_back(db: Path, interval: float) -> None:
    saved = sqlite3.connect(":memory:")
    with sqlite3.connect(db) as conn:
        conn.backup(saved)
        conn.execute("DROP TABLE entries")
    d = Dispatcher(Store.open(f"sqlite:///{db}"), H200, DispatchOptions(refresh_interval=interval))
    try:
        assert d.dispatch(SHAPE, "uniform").reason == "store_error"
        assert d.dispatch(SHAPE, UnhashableRouting()).reason == "store_error"
        with sqlite3.connect(db) as conn:
            saved.backup(conn)
        deadline = time.monotonic() + 5.0
        while d.dispatch(SHAPE, "uniform").reason == "store_error":
            assert time.monotonic() < deadline, "a store_error answer was never read again"
            time.sleep(0.01)
        assert d.dispatch(SHAPE, "uniform").reason == "exact_match"
    finally:
        d.close()


def test_an_unopenable_default_store_answers_store_error_and_warns(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    default_dispatcher: None,
) -> None:
    db = tmp_path / "mxdb.sqlite"
    db.write_bytes(b"not a database" * 512)
    monkeypatch.setenv("MXDB_DB", f"sqlite:///{db}")
    monkeypatch.delenv("MXDB_MODEL", raising=False)
    with caplog.at_level(logging.WARNING, logger="mxdb.dispatcher"):
        decision = mxdb.dispatch(SHAPE, "uniform")
    assert (decision.is_fallback, decision.reason) == (True, "store_error")
    assert any(str(db) in r.getMessage() for r in caplog.records)
