"""Drift governance: stale marking by changed component, re-tune workloads, guards (CPU)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from mxdb import Dispatcher, DispatchOptions, KernelConfig, MoEShape
from mxdb.cli.app import cli
from mxdb.configs import GemmConfig
from mxdb.fingerprint import POLICIES, fingerprint_document, recorded
from mxdb.models import FINGERPRINT_COMPONENTS, Entry, Fingerprint
from mxdb.runtime.drift import check, guard
from mxdb.store import Store
from mxdb.tune.fake import FakeBackend
from mxdb.tune.workload import load_workload

SHAPE = MoEShape(experts=8, hidden=4096, intermediate=14336, topk=2, tokens=16, dtype="bf16")
CFG = KernelConfig.uniform(
    GemmConfig(block_m=16, block_n=128, block_k=64, num_warps=4, num_stages=3)
)


def _entry(fp: Fingerprint, *, tokens: int = 16, routing: str = "uniform",
           median_us: float | None = None, config: KernelConfig = CFG) -> Entry:  # fmt: skip
    s = SHAPE.with_tokens(tokens)
    return Entry(
        dtype=s.dtype, family=s.family, dims=s.dims(), tokens=tokens, routing_class=routing,
        config=config.model_dump(), config_hash=config.hash, fingerprint_hash=fp.hash,
        status="verified", source="tune", speedup=1.2, noise_band=0.01, median_us=median_us,
    )  # fmt: skip


@pytest.fixture()
def db(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'mxdb.sqlite'}"


@pytest.fixture()
def store(db: str) -> Iterator[Store]:
    s = Store.open(db)
    yield s
    s.close()


def _upgrade(fp: Fingerprint, component: str) -> Fingerprint:
    old = fp.components()[component]
    ints = ("sm_count", "smem_per_block", "warp_size")
    new: Any = (old or 0) + 1 if component in ints else f"{old or 'none'}-upgraded"
    return Fingerprint(**{**fp.components(), component: new})


@pytest.mark.parametrize("name", ["c500-m0", "h200"])
@pytest.mark.parametrize("component", FINGERPRINT_COMPONENTS)
@pytest.mark.parametrize("policy", ["strict", "device"])
def test_each_component_upgrade(store: Store, name: str, component: str, policy: str) -> None:
    old = recorded(name)
    store.put_fingerprint(old)
    [eid] = store.add_entries([_entry(old)])
    new = _upgrade(old, component)
    report = check(store, new, policy=policy, mark=True)
    breaks = component in POLICIES[policy]
    assert report["marked"] == (1 if breaks else 0)
    assert store.get_entry(eid).status == ("stale" if breaks else "verified")
    if breaks:
        [d] = report["drifted"]
        assert d["breaking"] == [component] and d["entries"] == [eid]
        assert component in (store.get_entry(eid).stale_reason or "")
        # The dispatcher never answers with it, and says why.
        dec = Dispatcher(store, old, DispatchOptions(policy=policy)).dispatch(SHAPE, "uniform")
        assert (dec.is_fallback, dec.reason) == (True, "stale")
    else:
        assert report["drifted"] == []
        dec = Dispatcher(store, new, DispatchOptions(policy=policy)).dispatch(SHAPE, "uniform")
        assert dec.entry_id == eid


def test_cross_device_and_workload(store: Store, tmp_path: Path) -> None:
    c500, h200 = recorded("c500-m0"), recorded("h200")
    for fp in (c500, h200):
        store.put_fingerprint(fp)
    ids = store.add_entries(
        [_entry(c500, tokens=t, routing=r) for t, r in ((16, "uniform"), (64, "hot"))]
        + [_entry(h200, tokens=256, routing="skewed")]
    )
    out = tmp_path / "retune.yaml"
    report = check(store, h200, policy="device", mark=True, workload_out=out)
    assert report["marked"] == 2 and store.get_entry(ids[2]).status == "verified"
    [d] = report["drifted"]
    assert {"vendor", "device_name", "warp_size"} <= set(d["breaking"])
    wl = load_workload(out)
    assert wl.tokens == [16, 64] and wl.dtypes == ["bf16"]
    assert [r.kind for r in wl.routings] == ["hot", "uniform"]
    assert (wl.models[0].experts, wl.models[0].hidden, wl.models[0].topk) == (8, 4096, 2)
    # Idempotent: a second check marks nothing, but the workload still covers the stale keys.
    again = check(store, h200, policy="device", mark=True)
    assert again["marked"] == 0 and again["already_stale"] == 2
    assert again["workload"]["tokens"] == [16, 64]


def test_cli_check_exit_codes_and_json(store: Store, db: str, tmp_path: Path) -> None:
    old, new = recorded("h200"), _upgrade(recorded("h200"), "torch")
    store.put_fingerprint(old)
    store.add_entries([_entry(old)])
    fp_file = tmp_path / "fp.json"
    fp_file.write_text(json.dumps(fingerprint_document(new)))
    runner = CliRunner()
    base = ["drift", "check", "--db", db, "--fingerprint", str(fp_file)]
    dry = runner.invoke(cli, base)
    assert dry.exit_code == 1 and "would mark 1" in dry.output
    assert store.entries(status="stale") == []
    res = runner.invoke(cli, [*base, "--mark", "--json", "--out", str(tmp_path / "w.yaml")])
    assert res.exit_code == 1, res.output
    doc = json.loads(res.output)
    assert doc["marked"] == 1 and doc["drifted"][0]["breaking"] == ["torch"]
    assert load_workload(tmp_path / "w.yaml").tokens == [16]
    res = runner.invoke(cli, [*base, "--mark"])
    assert res.exit_code == 0 and "marked 0" in res.output
    same = tmp_path / "same.json"
    same.write_text(json.dumps(fingerprint_document(old)))
    res = runner.invoke(cli, ["drift", "check", "--db", db, "--fingerprint", str(same)])
    assert res.exit_code == 0 and "no drift" in res.output


def _fake_medians(be: FakeBackend, shape: Any, config: KernelConfig) -> tuple[float, float]:
    """The fake backend's medians of ``config`` and of FlagGems' choice, as the guard sees them."""
    ids = __import__("mxdb.routing_gen", fromlist=["generate"]).generate(
        "uniform", shape.tokens, shape.experts, shape.topk, 0
    )
    t, b = be.time(shape, ids, [config, be.baseline_config(shape)], reps=5, seed=0)
    return sorted(t.samples_us)[2], sorted(b.samples_us)[2]


def test_guard_with_fake_backend(store: Store, db: str) -> None:
    be = FakeBackend(noise=0.001)
    fp = be.fingerprint()
    store.put_fingerprint(fp)
    other = KernelConfig.uniform(
        GemmConfig(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=2)
    )
    s16, s64, s256 = SHAPE.with_tokens(16), SHAPE.with_tokens(64), SHAPE.with_tokens(256)
    t16, b16 = _fake_medians(be, s16, CFG)
    t64, b64 = _fake_medians(be, s64, other)
    t256, b256 = _fake_medians(be, s256, other)
    good = _entry(fp, median_us=t16).model_copy(update={"speedup": b16 / t16})
    # recorded as twice the advantage it has: it lost its speedup over FlagGems' choice
    lost = _entry(fp, tokens=64, config=other, median_us=t64 / 2).model_copy(
        update={"speedup": 2 * b64 / t64}
    )
    # the whole machine got slower (both configs alike): the speedup holds, not flagged
    env = _entry(fp, tokens=256, config=other, median_us=t256 / 1.3).model_copy(
        update={"speedup": b256 / t256}
    )
    good_id, lost_id, env_id = store.add_entries([good, lost, env])
    report = guard(store, FakeBackend(noise=0.001), threshold=0.05, mark=True)
    rows = {r["entry_id"]: r for r in report["results"]}
    assert rows[good_id]["flagged"] is False and rows[good_id]["status"] == "ok"
    assert rows[lost_id]["flagged"] is True and rows[lost_id]["status"] == "slower"
    assert rows[lost_id]["drift"] == pytest.approx(0.5, rel=0.02)
    assert rows[env_id]["flagged"] is False and rows[env_id]["ratio"] == pytest.approx(
        1.3, rel=0.02
    )
    assert report["marked"] == 1 and store.get_entry(lost_id).status == "stale"
    res = CliRunner().invoke(cli, ["drift", "guard", "--db", db, "--backend", "fake", "--json"])
    assert res.exit_code == 0, res.output  # the drifted entry is now stale: not a guard
    assert json.loads(res.output)["guards"] == 2
