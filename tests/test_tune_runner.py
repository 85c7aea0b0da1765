"""``tune`` end to end on the fake backend: claims, kills, budgets, evidence, the CLI."""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time
from pathlib import Path

from click.testing import CliRunner

from mxdb.audit import audit_bundle
from mxdb.cli.app import cli
from mxdb.store import Store
from mxdb.tune.fake import FakeBackend
from mxdb.tune.runner import job_name, tune
from mxdb.tune.workload import Workload, parse_workload

SMALL = {
    "name": "t",
    "models": ["qwen3-30b-a3b"],
    "tokens": [4, 16],
    "dtypes": ["bf16"],
    "routings": [{"kind": "uniform"}, {"kind": "zipf", "exponent": 1.2}],
    "search": {"max_candidates": 40, "halving_rounds": 2, "replicates": 3},
}


def _wl(**over: object) -> Workload:
    return parse_workload({**SMALL, **over})


def _prefixes(store: Store, job: str) -> dict[str, set[str]]:
    """Per point key: the run-id prefixes (one per attempt that wrote anything)."""
    from mxdb.tune.runner import _job_measurements

    out: dict[str, set[str]] = {}
    for p in _wl().points():
        ms = _job_measurements(store, job, p.shape, p.key)
        out[p.key] = {m.run_id.rsplit("-", 1)[0] for m in ms if m.role == "baseline"}
    return out


def test_tune_writes_store_and_audited_bundle(db_url: str, tmp_path: Path) -> None:
    wl = _wl()
    rep = tune(
        wl, store_url=db_url, out_dir=tmp_path / "ev", backend_factory=FakeBackend, progress=False
    )
    assert rep.points_done == rep.points_total == 4 and rep.points_measured == 4
    assert rep.verified, "the fake baseline is slower than the best configs by far"
    assert rep.bundle is not None and rep.bundle == rep.bundles[0]
    # two routing sources: one bundle each, so that no comparison group mixes two traces
    assert len(rep.bundles) == 2
    verified_groups = exported = 0
    for b in rep.bundles:
        result = audit_bundle(Path(b))
        assert not result.findings, result.findings
        summary = json.loads((Path(b) / "summary.json").read_text())
        verified_groups += summary["counts"]["verified_groups"]
        export = json.loads((Path(b) / "store_export.json").read_text())
        exported += len(export["entries"])
    assert verified_groups == exported == len(rep.verified)
    with Store.open(db_url) as store:
        assert len(store.entries(status="verified", source="tune")) == len(rep.verified)
        fails = [m for m in store.measurements() if m.status != "ok"]
        assert fails and all(m.error for m in fails)
    # a second run finds nothing to do and verifies nothing twice
    again = tune(
        wl, store_url=db_url, out_dir=tmp_path / "ev2", backend_factory=FakeBackend, progress=False
    )
    assert again.points_measured == 0 and again.points_done == 4
    with Store.open(db_url) as store:
        assert len(store.entries(status="verified", source="tune")) == len(rep.verified)


def test_budget_leaves_points_pending_and_rerun_finishes(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    wl = _wl()
    rep = tune(
        wl,
        store_url=url,
        out_dir=tmp_path / "ev",
        budget_minutes=1e-9,
        backend_factory=FakeBackend,
        progress=False,
    )
    assert rep.points_done == 0 and rep.budget_exhausted and rep.bundle is None
    rep = tune(
        wl, store_url=url, out_dir=tmp_path / "ev", backend_factory=FakeBackend, progress=False
    )
    assert rep.points_done == 4 and rep.points_measured == 4


def test_workers_share_points_and_survive_a_kill(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    wl = _wl()
    slow = functools.partial(FakeBackend, sleep_per_time_call_s=0.05)
    job = job_name(wl, FakeBackend().fingerprint())
    killed: list[int] = []

    def killer() -> None:
        deadline = time.time() + 60
        while time.time() < deadline and not killed:
            try:
                with Store.open(url) as store:
                    claimed = [p for p in store.points(job) if p.state == "claimed" and p.worker]
            except Exception:
                claimed = []
            if claimed:
                pid = int(str(claimed[0].worker).rsplit(":", 1)[1])
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.05)

    t = threading.Thread(target=killer)
    t.start()
    first = tune(
        wl,
        store_url=url,
        out_dir=tmp_path / "ev",
        devices=[0, 1],
        backend_factory=slow,
        progress=False,
        lease_s=600,
    )
    t.join()
    assert killed, "no worker was seen holding a claim"
    assert first.workers == 2 and first.points_done < 4  # the killed point stays claimed
    with Store.open(url) as store:
        workers = {p.worker for p in store.points(job) if p.state == "done"}
        assert all(w and "gpu" in w for w in workers)
    # expire the dead worker's lease and run again
    from datetime import datetime, timezone

    from sqlalchemy import create_engine, update

    from mxdb.store.schema import work_points

    eng = create_engine(url)
    with eng.begin() as conn:
        conn.execute(
            update(work_points)
            .where(work_points.c.state == "claimed")
            .values(expires_at=datetime(2000, 1, 1, tzinfo=timezone.utc))
        )
    eng.dispose()
    second = tune(
        wl, store_url=url, out_dir=tmp_path / "ev2", backend_factory=FakeBackend, progress=False
    )
    assert second.points_done == 4
    with Store.open(url) as store:
        per_point = _prefixes(store, job)
        assert all(len(v) == 1 for v in per_point.values()), per_point  # measured exactly once
        entries = store.entries(status="verified", source="tune")
        keys = [(e.family, e.dtype, e.tokens, e.routing_class, e.config_hash) for e in entries]
        assert len(keys) == len(set(keys))
        assert len(entries) <= 4
    assert second.bundle is not None and not audit_bundle(Path(second.bundle)).findings


def test_cli_tune_fake_json(tmp_path: Path) -> None:
    wl = tmp_path / "w.json"
    wl.write_text(json.dumps({**SMALL, "tokens": [4], "routings": [{"kind": "uniform"}]}))
    runner = CliRunner()
    res = runner.invoke(
        cli,
        [
            "tune",
            str(wl),
            "--db",
            f"sqlite:///{tmp_path / 'db.sqlite'}",
            "--out",
            str(tmp_path / "ev"),
            "--backend",
            "fake",
            "--json",
            "--no-progress",
        ],
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["points_done"] == 1 and data["bundle"]
    bad = runner.invoke(cli, ["tune", str(tmp_path / "nope.yaml"), "--backend", "fake"])
    assert bad.exit_code == 2 and "does not exist" in bad.output
    bad = runner.invoke(cli, ["tune", str(wl), "--backend", "fake", "--devices", "a,b"])
    assert bad.exit_code == 2 and "--devices" in bad.output


def test_compile_pool_start_up_is_not_charged_to_the_first_point(tmp_path: Path) -> None:
    """A slow first compile (a compile pool starting) must not eat the first point's budget."""
    from mxdb.tune.runner import work

    wl = _wl(tokens=[16], routings=[{"kind": "uniform"}])
    backend = FakeBackend(compile_startup_s=2.0)
    url = f"sqlite:///{tmp_path / 's.sqlite'}"
    fp = backend.fingerprint()
    job = job_name(wl, fp)
    from mxdb.tune.runner import build_points

    with Store.open(url) as store:
        store.add_points(
            job,
            [
                (p.key, {**p.payload(), "replay": r.to_payload(), "synthetic": s.to_payload()})
                for p, r, s in build_points(wl)
            ],
        )
        # 2.6 s in all: without the warm-up outside the budget, the start-up alone would use
        # more than the budget's search share and no candidate would be timed
        assert work(job, store, backend, wl.search, fp.hash, time.time() + 2.6) == 1
        ms = store.measurements()
    assert backend.counters.compile_calls >= 2
    assert any(m.fidelity == "synthetic" and m.samples_us for m in ms)
