"""``tune`` end to end on the fake backend: claims, kills, budgets, evidence, the CLI."""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from mxdb import KernelConfig, MoEShape
from mxdb.audit import audit_bundle
from mxdb.cli.app import cli
from mxdb.configs import GemmConfig
from mxdb.models import Measurement
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
        out[p.key] = {m.point or m.run_id.rsplit("-", 1)[0] for m in ms if m.role == "baseline"}
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
    singles: list[dict[str, Any]] = []
    for b in rep.bundles:
        result = audit_bundle(Path(b))
        assert not result.findings, result.findings
        summary = json.loads((Path(b) / "summary.json").read_text())
        verified_groups += summary["counts"]["verified_groups"]
        export = json.loads((Path(b) / "store_export.json").read_text())
        exported += sum(e["status"] != "imported" for e in export["entries"])
        singles += [e for e in export["entries"] if e["status"] == "imported"]
    # every verified entry won its replay comparison and each of its 3 held-out ones
    assert exported == len(rep.verified) + rep.baseline_keys
    # beside each winner the tables cannot hold (here fused_act), the best FlagGems config
    # faster than the baseline, audited with the bundle
    assert singles and all(e["source"] == "tune-single" for e in singles)
    assert all(KernelConfig.parse(e["config"]).single for e in singles)
    assert verified_groups >= 4 * len(rep.verified)
    assert all(v["speedup"] > 1.005 for v in rep.verified)
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
    backend = FakeBackend(compile_startup_s=4.5)
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
        # 5.8 s in all: without the warm-up outside the budget, the start-up alone would use
        # more than the budget's search share (75%: 4.35 s) and no candidate would be timed;
        # with it, the point has 1.3 s, room for its set-up on a loaded 2-core machine too
        assert work(job, store, backend, wl.search, fp.hash, time.time() + 5.8) == 1
        ms = store.measurements()
    assert backend.counters.compile_calls >= 2
    assert any(m.fidelity == "synthetic" and m.samples_us for m in ms)


def test_every_bundle_carries_its_keys_entries_when_routings_share_a_class(
    tmp_path: Path,
) -> None:
    """At small M several routing sources fall into one routing class; the store keeps one
    entry per key and config, and each source's bundle must still export it (audit clean)."""
    wl = _wl(
        tokens=[1, 2, 4, 8],
        routings=[
            {"kind": "uniform"},
            {"kind": "zipf", "exponent": 1.2},
            {"kind": "hot", "fraction": 0.5, "expert": 0},
        ],
        search={"max_candidates": 12, "halving_rounds": 1, "replicates": 2},
    )
    url = f"sqlite:///{tmp_path / 's.sqlite'}"
    rep = tune(wl, store_url=url, out_dir=tmp_path / "ev", backend_factory=FakeBackend,
               progress=False)  # fmt: skip
    assert rep.points_done == rep.points_total == 12
    assert len(rep.bundles) == 3
    for b in rep.bundles:
        result = audit_bundle(Path(b))
        assert not result.findings, result.findings


def test_points_where_flaggems_wins_are_stored_as_baseline_records(tmp_path: Path) -> None:
    """When nothing beats FlagGems' choice beyond the noise, the key is stored as a
    ``baseline`` entry (FlagGems' config), so the dispatcher answers FlagGems' choice there."""
    from mxdb import pointverdict
    from mxdb.dispatcher import Dispatcher
    from mxdb.tune.search import SearchResult
    from mxdb.tune.verify import point_entry

    shape = MoEShape(128, 2048, 768, 8, 16, "bf16")
    base = KernelConfig.uniform(
        GemmConfig(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=2)
    )
    other = KernelConfig.uniform(
        GemmConfig(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=3)
    )
    rounds = [100.0, 101.0, 100.5, 100.2, 100.8, 100.1, 100.6, 100.3]

    def m(rid: str, cfg: KernelConfig, role: str, samples: list[float]) -> Measurement:
        return Measurement(
            run_id=rid, dtype="bf16", family=shape.family, dims=shape.dims(), tokens=16,
            routing_class="uniform", config=cfg.model_dump(), config_hash=cfg.hash,
            fidelity="layer", status="ok", samples_us=samples, role=role,  # type: ignore[arg-type]
            max_abs_err=1e-3 if role == "candidate" else None,
            rel_err=1e-4 if role == "candidate" else None, comparison="replay", margin=0.005,
        )  # fmt: skip

    copies = [
        m("t-base", base, "baseline", rounds),
        m("t-ctl-a", base, "control", [x * 1.001 for x in rounds]),
        m("t-ctl-b", base, "control", [x * 0.999 for x in rounds]),
    ]
    finalist = m("t-fin01", other, "candidate", [x * 0.999 for x in rounds])
    result = SearchResult(
        shape=shape, measurements=[*copies, finalist], baseline=base, winner=None,
        winner_samples=[], baseline_samples=rounds, control_samples=([], []), correctness=None,
        budget_exhausted=False, spent_s=1.0,
    )  # fmt: skip

    def decide(ms: list[Measurement]) -> pointverdict.PointDecision:
        return pointverdict.decide([pointverdict.arm_from_measurement(x) for x in ms])

    # a budget that ran out before any finalist was timed compared nothing: no record
    nothing = decide(copies)
    assert nothing.status == "none"
    assert point_entry(replace(result, measurements=copies), nothing, routing_class="uniform",
                       fingerprint_hash=None, device_name=None) is None  # fmt: skip
    within = decide([*copies, finalist])
    assert within.status == "baseline", within.reason
    entry = point_entry(
        result, within, routing_class="uniform", fingerprint_hash="f" * 16, device_name="X"
    )
    assert entry is not None and entry.status == "baseline" and entry.config_hash == base.hash
    assert entry.median_us == entry.baseline_us == pytest.approx(100.4)
    assert entry.evidence == "t-base"
    be = FakeBackend()
    url = f"sqlite:///{tmp_path / 'b.sqlite'}"
    with Store.open(url) as store:
        store.put_fingerprint(be.fingerprint())
        store.add_entries([entry.model_copy(update={"fingerprint_hash": be.fingerprint().hash})])
        d = Dispatcher(store, be.fingerprint()).dispatch(shape, "uniform")
        # measured: nothing beat FlagGems' choice (the incumbent's row among the candidates)
        assert (d.level, d.reason, d.config) == ("fallback", "baseline_measured", None)


class _SlowOn(FakeBackend):
    """A fake host on which one config is three times slower (on every trace)."""

    def __init__(self, slow: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.slow = slow

    def true_us(self, shape: MoEShape, counts: Any, cfg: KernelConfig) -> float:
        t = super().true_us(shape, counts, cfg)
        return 3.0 * t if cfg.hash == self.slow else t


def test_a_verified_config_another_trace_of_its_key_contradicts_is_rejected(
    db_url: str, tmp_path: Path
) -> None:
    """Two traces of one routing class share a key: the second point times the first one's
    verified config on its own trace, and rejects it when it is slower than FlagGems' choice."""
    from mxdb.dispatcher import Dispatcher

    url = db_url
    one = _wl(tokens=[64], routings=[{"kind": "uniform"}], seed=0)
    rep = tune(one, store_url=url, out_dir=tmp_path, backend_factory=FakeBackend, progress=False)
    [won] = rep.verified
    first = KernelConfig.parse(won["config"])
    two = _wl(tokens=[64], routings=[{"kind": "uniform"}], seed=1)  # another trace, same class
    tune(two, store_url=url, out_dir=tmp_path, backend_factory=lambda: _SlowOn(first.hash),
         progress=False)  # fmt: skip
    with Store.open(url) as store:
        old = [e for e in store.entries(source="tune") if e.config_hash == first.hash]
        assert [e.status for e in old] == ["rejected"]
        assert "slower than FlagGems' choice" in (old[0].stale_reason or "")
        fp = FakeBackend().fingerprint()
        d = Dispatcher(store, fp).dispatch(one.points()[0].shape, "uniform")
        assert d.config != first


#: vLLM's H200 table of Qwen3-30B-A3B's experts (E=128, N=768), vendored for tests
H200_TABLE = (
    Path(__file__).parent.parent
    / "mxdb"
    / "data"
    / "vllm"
    / "E=128,N=768,device_name=NVIDIA_H200.json"
)


def _store_with_h200_vllm_table(tmp_path: Path, name: str) -> tuple[str, Path]:
    """A SQLite store URL with vLLM's H200 table of E=128, N=768 imported (the peer rows)."""
    vdir = tmp_path / "vllm"
    vdir.mkdir()
    (vdir / H200_TABLE.name).write_bytes(H200_TABLE.read_bytes())
    url = f"sqlite:///{tmp_path / name}.sqlite"
    res = CliRunner().invoke(cli, ["import", "vllm", str(vdir), "--db", url])
    assert res.exit_code == 0, res.output
    return url, H200_TABLE


class _TieWithPeer(FakeBackend):
    """A fake host on which one peer row runs 0.2% faster than FlagGems' choice (inside the
    tune's 0.5% margin) and every other config 30% slower."""

    def __init__(self, peer: str, **kw: Any) -> None:
        super().__init__(noise=0.0005, **kw)
        self.peer = peer

    def true_us(self, shape: MoEShape, counts: Any, cfg: KernelConfig) -> float:
        t = super().true_us(shape, counts, self.baseline_config(shape))
        if cfg.hash == self.baseline_config(shape).hash:
            return t
        return 0.998 * t if cfg.hash == self.peer else 1.3 * t


def test_a_peer_row_at_parity_is_stored_dispatched_and_audited(tmp_path: Path) -> None:
    """Rule 2 of mxdb.pointverdict end to end: nothing beats FlagGems' choice beyond the
    margin, vLLM's row ties with it on the replay and every held-out instance and is faster
    pooled over them, so the key answers vLLM's row (status parity)."""
    from mxdb.dispatcher import Dispatcher
    from mxdb.evidence.writer import write_manifest

    url, table = _store_with_h200_vllm_table(tmp_path, "p")
    raw = json.loads(table.read_text())["16"]
    peer = KernelConfig.uniform(GemmConfig.from_triton(raw))
    wl = _wl(tokens=[16], routings=[{"kind": "uniform"}])
    rep = tune(
        wl, store_url=url, out_dir=tmp_path / "ev",
        backend_factory=functools.partial(_TieWithPeer, peer.hash), progress=False,
    )  # fmt: skip
    assert rep.points_done == 1
    with Store.open(url) as store:
        (entry,) = store.entries(source="tune")
        assert entry.status == "parity" and entry.config_hash == peer.hash, entry
        assert entry.speedup is not None and 1.0 < entry.speedup < 1.005
        assert entry.validation and all(v["won"] for v in entry.validation)
        shape = MoEShape(128, 2048, 768, 8, 16, "bf16")
        d = Dispatcher(store, _TieWithPeer(peer.hash).fingerprint()).dispatch(shape, "uniform")
        assert (d.reason, d.level, d.config.hash) == ("parity", "exact", peer.hash)
        # a neighbouring token count is not answered by it, but by the incumbent: the
        # imported table's row there (vLLM's rule maps FAKE_H200 to NVIDIA_H200's tables)
        near = Dispatcher(store, _TieWithPeer(peer.hash).fingerprint()).dispatch(
            shape.with_tokens(20), "uniform"
        )
        assert (near.level, near.entry_id) == ("incumbent", None)
        assert near.source is not None and near.source.startswith("imported table")
    (bundle,) = rep.bundles
    assert not audit_bundle(Path(bundle)).findings
    runs = list((Path(bundle) / "runs").glob("*.json"))
    assert {json.loads(r.read_text())["schema_version"] for r in runs} == {"1.3"}  # rule 3
    # the bundle's export may not claim more than parity
    exp = Path(bundle) / "store_export.json"
    doc = json.loads(exp.read_text())
    doc["entries"][0]["status"] = "verified"
    exp.write_text(json.dumps(doc))
    write_manifest(Path(bundle), bundle_id=Path(bundle).name, milestone="t")
    checks = {f.check for f in audit_bundle(Path(bundle)).findings}
    assert "store_export.missing_config" in checks or "store_export.unbacked_entry" in checks


def test_parity_records_shared_by_routing_sources_audit_clean_together(tmp_path: Path) -> None:
    """At M=1 the uniform and hot sources fall in one class: both points decide the same parity
    record, the store keeps one row, and each bundle exports it; audited together, the bundle
    whose runs back it resolves the other's (as it must for verified and baseline entries)."""
    from mxdb.audit import audit_paths

    url, table = _store_with_h200_vllm_table(tmp_path, "p")
    peer = KernelConfig.uniform(GemmConfig.from_triton(json.loads(table.read_text())["1"]))
    wl = _wl(tokens=[1], routings=[{"kind": "uniform"}, {"kind": "hot", "fraction": 0.5}])
    rep = tune(
        wl, store_url=url, out_dir=tmp_path / "ev",
        backend_factory=functools.partial(_TieWithPeer, peer.hash), progress=False,
    )  # fmt: skip
    assert len(rep.bundles) == 2 and rep.parity_keys >= 1
    assert audit_paths([tmp_path / "ev"]).findings == ()


def test_rows_carry_their_job_and_bundles_hold_exactly_the_jobs_runs(
    db_url: str, tmp_path: Path
) -> None:
    """Every entry and measurement the tuner writes names its job (the store's job column),
    and a job's bundle is assembled from its rows alone: another job's rows that share its
    keys, or even its run-id and evidence prefixes, are not in it."""
    from mxdb.tune.runner import _job_entries, build_points, write_bundles

    one = _wl(tokens=[64], routings=[{"kind": "uniform"}], seed=0)
    two = _wl(tokens=[64], routings=[{"kind": "uniform"}], seed=1)  # same key, another job
    fp = FakeBackend().fingerprint()
    rep_a = tune(one, store_url=db_url, out_dir=tmp_path / "a", backend_factory=FakeBackend,
                 progress=False)  # fmt: skip
    rep_b = tune(two, store_url=db_url, out_dir=tmp_path / "b", backend_factory=FakeBackend,
                 progress=False)  # fmt: skip
    job_a, job_b = rep_a.job, rep_b.job
    assert job_a != job_b and job_a == job_name(one, fp)
    with Store.open(db_url) as store:
        ms = store.measurements()
        assert ms and {m.job for m in ms} == {job_a, job_b}
        assert all(m.run_id.startswith(m.point) for m in ms if m.point)
        tuned = store.entries()
        assert tuned and all(e.job in (job_a, job_b) for e in tuned)
        own_a = {m.run_id for m in store.measurements(job=job_a)}
        entries_a = _job_entries(store, job_a, fp.hash)
        assert entries_a and all(e.job == job_a for e in entries_a)
        # rows of job B that look like job A's by every prefix: its run ids and evidence
        forged = [
            m.model_copy(update={"id": None, "run_id": m.run_id + "-b", "job": job_b})
            for m in store.measurements(job=job_a)
        ]
        store.add_measurements(forged)
        store.add_entries(
            [
                e.model_copy(update={"id": None, "device_name": "elsewhere", "job": job_b})
                for e in entries_a
            ]
        )
        assert [e.id for e in _job_entries(store, job_a, fp.hash)] == [e.id for e in entries_a]
        paths = write_bundles(
            store, job_a, one, fp, build_points(one), entries_a, tmp_path / "again"
        )
    [bundle] = paths
    assert not audit_bundle(bundle).findings
    runs = {p.stem for p in (bundle / "runs").glob("*.json")}
    assert runs and runs <= own_a
    first = {p.stem for p in (Path(rep_a.bundles[0]) / "runs").glob("*.json")}
    assert runs == first


class _PeerSlower(_TieWithPeer):
    """The same host, but the peer row 3% slower than FlagGems' choice: nothing beats or ties
    with FlagGems' choice, so the key is a baseline record."""

    def true_us(self, shape: MoEShape, counts: Any, cfg: KernelConfig) -> float:
        t = super().true_us(shape, counts, cfg)
        return t / 0.998 * 1.03 if cfg.hash == self.peer else t


def test_a_later_tune_of_the_same_trace_supersedes_the_earlier_decision(tmp_path: Path) -> None:
    """Tuned once (a baseline record), then again by another job replaying the same trace on a
    host where vLLM's row ties with FlagGems' choice: the parity record answers the key and the
    earlier baseline record is rejected, naming what superseded it."""
    from mxdb.dispatcher import Dispatcher

    url, table = _store_with_h200_vllm_table(tmp_path, "s")
    peer = KernelConfig.uniform(GemmConfig.from_triton(json.loads(table.read_text())["16"]))
    first = _wl(tokens=[16], routings=[{"kind": "uniform"}])
    rep1 = tune(first, store_url=url, out_dir=tmp_path / "a", progress=False,
                backend_factory=functools.partial(_PeerSlower, peer.hash))  # fmt: skip
    assert rep1.baseline_keys == 1
    again = _wl(name="t-again", tokens=[16], routings=[{"kind": "uniform"}])
    rep2 = tune(again, store_url=url, out_dir=tmp_path / "b", progress=False,
                backend_factory=functools.partial(_TieWithPeer, peer.hash))  # fmt: skip
    assert rep2.job != rep1.job and rep2.parity_keys == 1
    with Store.open(url) as store:
        rows = {e.status: e for e in store.entries(source="tune")}
        assert set(rows) == {"parity", "rejected"}
        assert rows["rejected"].stale_reason is not None
        assert "superseded by a later tune of trace" in rows["rejected"].stale_reason
        shape = MoEShape(128, 2048, 768, 8, 16, "bf16")
        d = Dispatcher(store, _TieWithPeer(peer.hash).fingerprint()).dispatch(shape, "uniform")
        assert (d.reason, d.config.hash) == ("parity", peer.hash)
    from mxdb.audit import audit_paths

    assert audit_paths([tmp_path / "a", tmp_path / "b"]).findings == ()


def test_a_later_job_deciding_a_stored_key_and_config_exports_that_row(tmp_path: Path) -> None:
    """Two jobs, two traces of one key, the same winner: the store keeps the first job's row,
    and the second job's bundle exports it too (its decision is in its export), backed by the
    first job's bundle when both are audited."""
    from mxdb.audit import audit_paths

    url = f"sqlite:///{tmp_path / 's.sqlite'}"
    one = _wl(tokens=[64], routings=[{"kind": "uniform"}], seed=0)
    two = _wl(tokens=[64], routings=[{"kind": "uniform"}], seed=1)
    rep_a = tune(one, store_url=url, out_dir=tmp_path / "ev", backend_factory=FakeBackend,
                 progress=False)  # fmt: skip
    rep_b = tune(two, store_url=url, out_dir=tmp_path / "ev", backend_factory=FakeBackend,
                 progress=False)  # fmt: skip
    with Store.open(url) as store:
        rows = store.entries(source="tune", status="verified")
    assert len(rows) == 1 and rows[0].job == rep_a.job
    (bundle_b,) = rep_b.bundles
    exported = json.loads((Path(bundle_b) / "store_export.json").read_text())["entries"]
    assert [e["config_hash"] for e in exported if e["status"] == "verified"] == [
        rows[0].config_hash
    ]
    assert audit_paths([tmp_path / "ev"]).findings == ()


def test_noisy_records_are_the_ties_decided_under_a_wide_noise_band() -> None:
    from types import SimpleNamespace

    from mxdb.tune.runner import NOISY_BAND, noisy_records

    def e(status: str, band: float | None) -> Any:
        return SimpleNamespace(
            family="E8-H4096-I14336-k2", dtype="bf16", tokens=4096, routing_class="hot",
            status=status, noise_band=band,
        )  # fmt: skip

    entries = [e("baseline", 0.052), e("baseline", 0.0005), e("verified", 0.05),
               e("baseline", None), e("parity", 0.03), e("single", 0.05)]  # fmt: skip
    key = {"family": "E8-H4096-I14336-k2", "dtype": "bf16", "tokens": 4096, "routing_class": "hot"}
    assert noisy_records(entries) == [
        {**key, "status": "baseline", "noise_band": 0.052},
        {**key, "status": "parity", "noise_band": 0.03},
    ]
    assert noisy_records([e("baseline", NOISY_BAND)]) == []  # wider than, not as wide as


def _cli_tune(tmp_path: Path, *extra: str) -> Any:
    tmp_path.mkdir(exist_ok=True)
    wl = tmp_path / "w.json"
    wl.write_text(json.dumps({**SMALL, "tokens": [4, 16]}))
    db = f"sqlite:///{tmp_path / 'db.sqlite'}"
    args = ["tune", str(wl), "--db", db, "--out", str(tmp_path / "ev"), "--backend", "fake"]
    return CliRunner().invoke(cli, [*args, "--no-progress", *extra])


def test_a_tune_names_the_noisy_ties_it_decided(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mxdb.tune.fake

    # a disturbed device: every sample carries 30% log-normal noise
    noisy = functools.partial(mxdb.tune.fake.FakeBackend, noise=0.30)
    monkeypatch.setattr(mxdb.tune.fake, "FakeBackend", noisy)
    res = _cli_tune(tmp_path, "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["noisy"], "30% noise leaves ties decided under a wide band"
    assert all(n["noise_band"] > 0.02 for n in report["noisy"])
    with Store.open(f"sqlite:///{tmp_path / 'db.sqlite'}") as store:
        entries = store.entries()
    ties = {
        (e.tokens, e.routing_class, e.status) for e in entries if e.status in ("baseline", "parity")
    }
    assert {(n["tokens"], n["routing_class"], n["status"]) for n in report["noisy"]} <= ties
    text = _cli_tune(tmp_path / "again")  # a fresh store, the text output
    assert text.exit_code == 0, text.output
    assert "noisy: E128-H2048-I768-k8 bf16 M=" in text.stderr
    assert "measure the key again" in text.stderr


def test_a_quiet_tune_names_no_noisy_records(tmp_path: Path) -> None:
    res = _cli_tune(tmp_path, "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["noisy"] == []
