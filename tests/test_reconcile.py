"""Key reconciliation (mxdb.tune.reconcile): one decision for the traces of a key that disagree.

Driven end to end on the fake backend: a workload whose two routing sources fall in one class at
Mixtral's M = 4 (as on the H200: uniform and hot-expert traces both classify ``uniform``), tuned,
given a disagreeing decision at that key, then reconciled through the CLI; the bundle is audited
and tampered with.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from mxdb import pointverdict
from mxdb.audit import audit_bundle
from mxdb.cli.app import cli
from mxdb.dispatcher import Dispatcher
from mxdb.evidence.writer import write_manifest
from mxdb.models import Entry
from mxdb.store import Store
from mxdb.tune.fake import FakeBackend
from mxdb.tune.reconcile import SOURCE, conflicting_keys, reconcile
from mxdb.tune.runner import build_points, job_name, tune
from mxdb.tune.workload import parse_workload

WL = {
    "name": "rk",
    "models": ["mixtral-8x7b"],
    "tokens": [4],
    "dtypes": ["bf16"],
    "routings": [{"kind": "uniform"}, {"kind": "hot", "fraction": 0.5, "expert": 0}],
    "search": {"max_candidates": 12, "halving_rounds": 1, "replicates": 2, "impls": ["flaggems"]},
}


def _workload(tmp_path: Path) -> tuple[object, Path]:
    path = tmp_path / "rk.json"
    path.write_text(json.dumps(WL))
    return parse_workload(WL), path


class _Faster(FakeBackend):
    """Every config but FlagGems' choice runs 7% faster than it, on every routing."""

    def true_us(self, shape, counts, cfg):  # type: ignore[no-untyped-def]
        base = self.baseline_config(shape)
        t = super().true_us(shape, counts, base)
        return t if cfg.hash == base.hash else 0.93 * t


def _key_rows(store: Store, cls: str = "uniform") -> list[Entry]:
    return [
        e
        for e in store.entries(family="E8-H4096-I14336-k2")
        if e.tokens == 4 and e.routing_class == cls and e.source in ("tune", SOURCE)
    ]


def test_reconcile_decides_a_disagreeing_key_once(tmp_path: Path) -> None:
    wl, path = _workload(tmp_path)
    classes = {r.routing_class for _, r, _ in build_points(wl)}
    assert classes == {"uniform"}, "both sources must share the key for this test"
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    run = CliRunner().invoke
    # before the tune: nothing to reconcile, and it says what to do
    res = run(cli, ["tune", str(path), "--db", url, "--backend", "fake", "--reconcile"])
    assert res.exit_code == 2 and "run mxdb tune 'rk' first" in res.output
    res = run(cli, ["tune", str(path), "--db", url, "--backend", "fake", "--reconcile",
                    "--budget", "1"])  # fmt: skip
    assert res.exit_code == 2 and "drop --devices and --budget" in res.output
    rep = tune(wl, store_url=url, out_dir=tmp_path / "ev", backend_factory=_Faster,
               progress=False)  # fmt: skip
    assert rep.points_done == 2
    fb = _Faster(seed=wl.seed)
    with Store.open(url) as store:
        rows = _key_rows(store)
        assert rows and all(e.status in ("verified", "baseline", "parity") for e in rows)
        # a third routing source of the class found nothing faster there: a baseline record
        # at the key, which the dispatcher lets outrank every verified config
        base = fb.baseline_config(build_points(wl)[0][0].shape)
        store.add_entries([
            rows[0].model_copy(update={
                "id": None, "status": "baseline", "config": base.model_dump(),
                "config_hash": base.hash, "speedup": 1.0, "evidence": None, "validation": None,
            })
        ])  # fmt: skip
        shape = build_points(wl)[0][0].shape
        d = Dispatcher(store, fb.fingerprint()).dispatch(shape, "uniform")
        assert d.reason == "baseline_measured"
        (key,) = conflicting_keys(wl, store, fb.fingerprint().hash)
        # every trace of the key: both points' replays and held-out instances
        assert len(key[1]["traces"]) == 2 * (1 + wl.search.heldout)
        before = {e.id for e in _key_rows(store)}
    out = reconcile(wl, fb, url, tmp_path / "ev").to_dict()
    assert out["keys"] == 1 and out["job"] == f"{job_name(wl, fb.fingerprint())}-reconcile"
    (dec,) = out["decisions"]
    with Store.open(url) as store:
        rows = _key_rows(store)
        old = [e for e in rows if e.id in before]
        assert all(e.status == "rejected" and "reconciled over 8 traces" in (e.stale_reason or "")
                   for e in old)  # fmt: skip
        (new,) = [e for e in rows if e.source == SOURCE]
        assert new.status == dec["status"] == "verified" and new.config_hash == dec["config_hash"]
        assert new.confidence == 1.0 and new.speedup == pytest.approx(1 / 0.93, rel=0.02)
        assert [v["comparison"] for v in new.validation or []] == [f"key-{i}" for i in range(1, 9)]
        d = Dispatcher(store, fb.fingerprint()).dispatch(shape, "uniform")
        assert (d.reason, d.entry_id, d.config.hash) == ("exact_match", new.id, new.config_hash)
        # nothing left to reconcile; running again changes nothing
        assert conflicting_keys(wl, store, fb.fingerprint().hash) == []
    again = run(cli, ["tune", str(path), "--db", url, "--backend", "fake", "--reconcile",
                      "--out", str(tmp_path / "ev2")])  # fmt: skip
    assert again.exit_code == 0, again.output
    assert "1 key(s) decided" in again.output and dec["config_hash"] in again.output
    bundle = Path(out["bundle"])
    assert not audit_bundle(bundle).findings
    runs = [json.loads(p.read_text()) for p in (bundle / "runs").glob("*.json")]
    assert {r["comparison"] for r in runs} == {f"key-{i}" for i in range(1, 9)}
    assert {r["schema_version"] for r in runs} == {"1.3"}
    # the export may not claim another status than the one its runs decide
    exp = bundle / "store_export.json"
    doc = json.loads(exp.read_text())
    doc["entries"][0]["status"] = "parity"
    exp.write_text(json.dumps(doc))
    write_manifest(bundle, bundle_id=bundle.name, milestone="rk")
    checks = {f.check for f in audit_bundle(bundle).findings}
    assert checks & {"store_export.missing_config", "store_export.unbacked_entry"}, checks


@pytest.mark.parametrize("status", ["verified", "parity", "baseline"])
def test_decide_key_statuses(status: str) -> None:
    from tests.test_verdict import COPIES, _comparison

    us = {"verified": [97.0, 97.5, 96.8], "parity": [97.0, 99.95, 97.5],
          "baseline": [97.0, 103.0, 97.5]}[status]  # fmt: skip
    arms = [
        a
        for i, x in enumerate(us)
        for a in _comparison(
            f"key-{i + 1}",
            {**COPIES, "a": ("candidate", "W", x), "b": ("candidate", "V", 101.0)},
            seed=i + 40,
        )
    ]
    assert pointverdict.is_key_point(arms)
    d = pointverdict.decide_key(arms)
    assert d.status == status
    if status != "baseline":
        assert d.config_hash == "W" and d.evidence == "key-1-a"
        assert [v["comparison"] for v in d.validation] == ["key-1", "key-2", "key-3"]
        assert d.confidence == pytest.approx(1.0 if status == "verified" else 2 / 3)
    else:
        assert d.config_hash == "B" and "3 of its traces" in d.reason


def test_decide_key_prefers_verified_and_heeds_a_faster_peer_row() -> None:
    from tests.test_verdict import COPIES, _comparison

    def key(w: list[float], v: list[float], p: list[float] | None = None) -> list:
        out = []
        for i in range(3):
            arms = {**COPIES, "a": ("candidate", "W", w[i]), "b": ("candidate", "V", v[i])}
            if p is not None:
                arms["p"] = ("peer", "P", p[i])
            out += _comparison(f"key-{i + 1}", arms, seed=i + 50)
        return out

    # V is faster pooled but ties once; W is faster everywhere: W
    d = pointverdict.decide_key(key([98.0, 98.0, 98.0], [90.0, 99.98, 90.0]))
    assert (d.status, d.config_hash) == ("verified", "W")
    # vLLM's row is faster than both on one trace: neither holds; the row itself loses one
    d2 = pointverdict.decide_key(key([98.0] * 3, [97.0] * 3, [101.0, 90.0, 101.0]))
    assert d2.status == "baseline"
    # the peer row faster everywhere is the answer, verified as such
    d3 = pointverdict.decide_key(key([98.0] * 3, [97.0] * 3, [90.0] * 3))
    assert (d3.status, d3.config_hash) == ("verified", "P")
