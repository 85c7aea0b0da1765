"""Work claiming for `mxdb tune`: points, leases, stolen claims, real competing processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from mxdb.models import Entry, Measurement
from mxdb.store import Claim, Store


def _entry(tokens: int) -> Entry:
    return Entry(
        dtype="bf16",
        family="E8-H64-I128-k2",
        dims={"tokens": tokens},
        tokens=tokens,
        config={"block_m": 16},
        config_hash="c",
        status="verified",
        source="tune",
    )


def _measurement(run_id: str, tokens: int = 1) -> Measurement:
    return Measurement(
        run_id=run_id,
        dtype="bf16",
        family="E8-H64-I128-k2",
        dims={"tokens": tokens},
        tokens=tokens,
        routing_class="uniform",
        config={"block_m": 16},
        config_hash="c",
        status="ok",
        samples_us=[1.0],
    )


def test_add_points_is_idempotent(store: Store) -> None:
    assert store.add_points("job", [("a", {"m": 1}), ("b", {"m": 2})]) == 2
    assert store.add_points("job", [("b", {"m": 99}), ("c", {})]) == 1
    assert store.add_points("other", [("a", {})]) == 1
    assert store.add_points("job", []) == 0
    states = store.points("job")
    assert [(p.key, p.state, p.worker, p.attempts) for p in states] == [
        ("a", "pending", None, 0),
        ("b", "pending", None, 0),
        ("c", "pending", None, 0),
    ]


def test_claim_complete_cycle(store: Store) -> None:
    store.add_points("job", [("p1", {"tokens": 16, "cfg": [1, 2]}), ("p2", {"tokens": 32})])
    c1 = store.claim_point("job", "w1", lease_s=60)
    c2 = store.claim_point("job", "w2", lease_s=60)
    assert c1 is not None and c2 is not None
    assert {c1.key, c2.key} == {"p1", "p2"}
    assert store.claim_point("job", "w3") is None  # both held
    assert store.claim_point("nojob", "w3") is None
    p1 = c1 if c1.key == "p1" else c2
    assert p1.payload == {"tokens": 16, "cfg": [1, 2]}
    assert p1.expires_at.tzinfo is not None
    assert c1.token != c2.token

    g0 = store.generation()
    assert store.complete_point(c1, entries=[_entry(16)], measurements=[_measurement("m1")])
    assert store.generation() > g0
    assert len(store.entries()) == 1 and len(store.measurements()) == 1
    assert store.complete_point(c1) is False  # done already
    assert store.renew_claim(c1, 60) is False
    assert store.renew_claim(c2, 120) is True
    assert store.complete_point(c2)  # nothing to write is fine
    states = {p.key: p for p in store.points("job")}
    assert states[c1.key].state == "done" and states[c1.key].worker == "w1"
    assert states[c2.key].state == "done" and states[c2.key].attempts == 1
    assert store.claim_point("job", "w1") is None


def test_stolen_claim_writes_nothing(store: Store) -> None:
    store.add_points("job", [("only", {})])
    first = store.claim_point("job", "slow", lease_s=0.05)
    assert first is not None
    time.sleep(0.15)
    second = store.claim_point("job", "fast", lease_s=60)
    assert second is not None and second.key == "only"
    g0 = store.generation()
    assert not store.complete_point(first, entries=[_entry(1)], measurements=[_measurement("x")])
    assert store.entries() == [] and store.measurements() == []
    assert store.generation() == g0
    assert store.renew_claim(first, 60) is False
    [state] = store.points("job")
    assert (state.state, state.worker, state.attempts) == ("claimed", "fast", 2)
    assert store.complete_point(second, measurements=[_measurement("y")])
    assert [m.run_id for m in store.measurements()] == ["y"]


def test_expired_claim_not_yet_taken_still_completes(store: Store) -> None:
    store.add_points("job", [("k", {})])
    claim = store.claim_point("job", "w", lease_s=0.01)
    assert claim is not None
    time.sleep(0.05)
    assert store.renew_claim(claim, 60)  # still held: nobody took it
    assert store.complete_point(claim, entries=[_entry(3)])
    assert store.points("job")[0].state == "done"


def test_claim_payload_round_trip(store: Store) -> None:
    payload: dict[str, Any] = {"shape": {"E": 8, "tokens": 64}, "config": None, "f": 0.5}
    store.add_points("j", [("x", payload)])
    claim = store.claim_point("j", "w")
    assert isinstance(claim, Claim) and claim.payload == payload
    assert claim.worker == "w" and claim.job == "j"


WORKER = """
import sys, time
from mxdb.models import Measurement
from mxdb.store import Store
url, job, name = sys.argv[1], sys.argv[2], sys.argv[3]
store = Store.open(url)
done = []
while True:
    claim = store.claim_point(job, name, lease_s=60)
    if claim is None:
        break
    time.sleep(0.003)  # "measure"
    m = Measurement(run_id=f"{claim.key}@{name}", dtype="bf16", family="f",
                    dims={"tokens": 1}, tokens=claim.payload["tokens"], routing_class="uniform",
                    config={}, config_hash="c", status="ok", samples_us=[1.0])
    if store.complete_point(claim, measurements=[m]):
        done.append(claim.key)
store.close()
print(" ".join(done))
"""

HOLDER = """
import sys, time
from mxdb.store import Store
url, job, marker = sys.argv[1], sys.argv[2], sys.argv[3]
store = Store.open(url)
claim = store.claim_point(job, "doomed", lease_s=float(sys.argv[4]))
open(marker, "w").write(claim.key)
time.sleep(120)
"""


def _spawn(script: str, *args: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_competing_workers_do_each_point_once(store: Store, db_url: str) -> None:
    n = 40
    store.add_points("sweep", [(f"p{i:03d}", {"tokens": i + 1}) for i in range(n)])
    procs = [_spawn(WORKER, db_url, "sweep", f"w{i}") for i in range(3)]
    completed: list[str] = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert "locked" not in err.lower()
        completed += out.split()
    assert sorted(completed) == [f"p{i:03d}" for i in range(n)]  # each exactly once
    ms = store.measurements()
    assert len(ms) == n
    assert sorted(m.run_id.split("@")[0] for m in ms) == sorted(completed)
    states = store.points("sweep")
    assert all(p.state == "done" and p.attempts == 1 for p in states)


@pytest.mark.parametrize("lease_s", [1.0])
def test_dead_workers_claim_is_taken_after_expiry(
    store: Store, db_url: str, tmp_path: Path, lease_s: float
) -> None:
    store.add_points("job", [("lonely", {"tokens": 1})])
    marker = tmp_path / "claimed"
    proc = _spawn(HOLDER, db_url, "job", marker, lease_s)
    deadline = time.monotonic() + 60
    try:
        while not marker.exists() or not marker.read_text():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    killed_at = time.monotonic()
    [state] = store.points("job")
    assert (state.state, state.worker) == ("claimed", "doomed")
    assert store.claim_point("job", "rescuer") is None  # lease still running
    claim = None
    while claim is None:
        assert time.monotonic() - killed_at < lease_s + 10, "claim never expired"
        time.sleep(0.05)
        claim = store.claim_point("job", "rescuer", lease_s=60)
    assert claim.key == "lonely"
    assert store.complete_point(claim, measurements=[_measurement("r")])
    [state] = store.points("job")
    assert (state.state, state.worker, state.attempts) == ("done", "rescuer", 2)


def test_a_later_point_deciding_a_stored_key_and_config_keeps_the_row(store: Store) -> None:
    """One row per key and config: a later point (another trace, another job) that decides the
    same key and config writes no row of its own; the first decision's row, rejected or not,
    stands (its bundle exports it, see tests/test_tune_runner.py)."""
    old = _entry(16).model_copy(
        update={"status": "baseline", "evidence": "job1-p-base", "speedup": 1.0, "confidence": None}
    )
    store.add_entries([old])
    store.add_entries([old.model_copy(update={"evidence": "import-again"})])  # an import: skipped
    assert [e.evidence for e in store.entries()] == ["job1-p-base"]
    store.add_points("job2", [("p", {})])
    claim = store.claim_point("job2", "w")
    assert claim is not None
    new = old.model_copy(update={"evidence": "job2-p-base", "noise_band": 0.004})
    assert store.complete_point(claim, entries=[new], measurements=[_measurement("job2-p-base")])
    (row,) = store.entries()
    assert (row.evidence, row.status) == ("job1-p-base", "baseline")
