"""Real processes against one database: concurrent writers, concurrent first opens, a kill.

SQLite must never answer "database is locked" to a writer (BEGIN IMMEDIATE plus
busy_timeout); a process killed inside a write transaction must leave no trace of it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from mxdb.store import Store

# Shared by the child scripts: an entry whose tokens identify (worker, transaction, row).
_PRELUDE = """
import sys, time, os
from mxdb.models import Entry
from mxdb.store import Store

def entry(tokens, source="tune"):
    return Entry(dtype="bf16", family="E8-H64-I128-k2", dims={"tokens": tokens}, tokens=tokens,
                 config={"block_m": 16}, config_hash="c", status="verified", source=source)

def wait_for(path):
    while not os.path.exists(path):
        time.sleep(0.002)
"""

WRITER = (
    _PRELUDE
    + """
url, go = sys.argv[1], sys.argv[5]
worker, txns, rows = (int(a) for a in sys.argv[2:5])
store = Store.open(url)
open(go + f".ready{worker}", "w").close()
wait_for(go)
for t in range(txns):
    base = worker * 1_000_000 + t * 1000
    store.add_entries([entry(base + r + 1) for r in range(rows)])
    store.add_measurements([])
    store.set_meta(f"w{worker}", str(t))
store.close()
print("done", worker)
"""
)

OPENER = (
    _PRELUDE
    + """
url, worker, go = sys.argv[1], int(sys.argv[2]), sys.argv[3]
open(go + f".ready{worker}", "w").close()
wait_for(go)
with Store.open(url) as store:
    store.add_entries([entry(worker + 1)])
print("done", worker)
"""
)

KILLED = (
    _PRELUDE
    + """
from sqlalchemy import event
from sqlalchemy.engine import Engine
url, marker = sys.argv[1], sys.argv[2]
armed = False

def hook(conn, cursor, statement, parameters, context, executemany):
    # Inside the transaction, right after the big INSERT ran: say so, then hang.
    if armed and statement.lstrip().upper().startswith("INSERT INTO ENTRIES"):
        with open(marker + ".tmp", "w") as fh:
            fh.write("inside")
        os.replace(marker + ".tmp", marker)
        time.sleep(120)

event.listen(Engine, "after_cursor_execute", hook)
store = Store.open(url)
store.add_entries([entry(t) for t in range(1, 11)])   # committed before the kill
armed = True
store.add_entries([entry(t, source="doomed") for t in range(1, 2001)])
print("not killed?!")
"""
)


def _spawn(script: str, *args: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _start_together(procs: list[subprocess.Popen[str]], go: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    for i in range(len(procs)):
        while not Path(f"{go}.ready{i}").exists():
            if procs[i].poll() is not None:
                raise AssertionError(f"worker {i} died: {procs[i].communicate()[1]}")
            assert time.monotonic() < deadline, "workers did not start"
            time.sleep(0.01)
    go.touch()


def _finish(procs: list[subprocess.Popen[str]]) -> None:
    for i, proc in enumerate(procs):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"worker {i} failed:\n{err}"
        assert "locked" not in err.lower()
        assert out.strip() == f"done {i}"


def test_concurrent_writers(db_url: str, tmp_path: Path) -> None:
    workers, txns, rows = 3, 40, 5
    with Store.open(db_url) as store:
        g0 = store.generation()
    go = tmp_path / "go"
    procs = [_spawn(WRITER, db_url, w, txns, rows, go) for w in range(workers)]
    _start_together(procs, go)
    _finish(procs)
    with Store.open(db_url) as store:
        tokens = sorted(e.tokens for e in store.entries())
        expected = sorted(
            w * 1_000_000 + t * 1000 + r + 1
            for w in range(workers)
            for t in range(txns)
            for r in range(rows)
        )
        assert tokens == expected
        assert store.generation() == g0 + workers * txns
        assert [store.get_meta(f"w{w}") for w in range(workers)] == [str(txns - 1)] * workers


def test_concurrent_first_open_of_a_fresh_database(db_url: str, tmp_path: Path) -> None:
    go = tmp_path / "go"
    procs = [_spawn(OPENER, db_url, w, go) for w in range(3)]
    _start_together(procs, go)
    _finish(procs)
    with Store.open(db_url) as store:
        assert sorted(e.tokens for e in store.entries()) == [1, 2, 3]
        assert store.generation() == 3


def test_killed_writer_leaves_no_trace(db_url: str, tmp_path: Path) -> None:
    marker = tmp_path / "inside"
    proc = _spawn(KILLED, db_url, marker)
    deadline = time.monotonic() + 60
    try:
        while not marker.exists():
            if proc.poll() is not None:
                raise AssertionError(f"writer exited early: {proc.communicate()}")
            assert time.monotonic() < deadline, "writer never reached its transaction"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    with Store.open(db_url) as store:
        assert store.entries(source="doomed") == []
        assert sorted(e.tokens for e in store.entries()) == list(range(1, 11))
        assert store.generation() == 1  # the killed transaction's bump is gone too
        # And the store works: the same rows go in now.
        from mxdb.models import Entry

        ids = store.add_entries(
            [
                Entry(
                    dtype="bf16",
                    family="E8-H64-I128-k2",
                    dims={"tokens": 5},
                    tokens=5,
                    config={"block_m": 16},
                    config_hash="c",
                    status="verified",
                    source="doomed",
                )
            ]
        )
        assert len(ids) == 1
        assert store.generation() == 2
        assert len(store.entries(source="doomed")) == 1
