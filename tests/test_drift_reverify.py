"""Drift on real stores: the shipped export (every op kind), dry runs, GPU-free fingerprints
that cannot judge GPU entries, and ``drift reverify`` with the fake backend (CPU)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest
from click.testing import CliRunner

from mxdb import Dispatcher, KernelConfig, MoEShape
from mxdb.cli.app import cli
from mxdb.configs import GemmConfig
from mxdb.decode_rule import DecodeCase
from mxdb.fingerprint import collect, fingerprint_document
from mxdb.models import Entry, Fingerprint
from mxdb.results import Correctness, Timing
from mxdb.runtime.drift import check, guard, has_gpu_facts, reverify
from mxdb.store import Store
from mxdb.tune.fake import FakeBackend
from mxdb.tune.workload import load_workload

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "evidence" / "store-export.json"
SHAPE = MoEShape(experts=8, hidden=4096, intermediate=14336, topk=2, tokens=16, dtype="bf16")


def _gemm(bm: int, bn: int, bk: int, stages: int) -> KernelConfig:
    return KernelConfig.uniform(
        GemmConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=4, num_stages=stages)
    )


# On the fake backend at SHAPE (uniform routing): BASE ~830 us, GOOD ~785 us, BAD ~874 us.
BASE, GOOD, BAD = _gemm(32, 64, 64, 2), _gemm(16, 128, 64, 3), _gemm(16, 32, 64, 2)


def _mxdb(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mxdb", *argv], capture_output=True, text=True, timeout=120
    )


@pytest.fixture()
def shipped(tmp_path: Path) -> str:
    """The shipped store export, imported into a fresh SQLite file with the real CLI."""
    url = f"sqlite:///{tmp_path / 'shipped.sqlite'}"
    out = _mxdb("import", "mxdb", str(SHIPPED), "--db", url)
    assert out.returncode == 0, out.stderr
    return url


def _upgraded(fp: Fingerprint, component: str = "triton") -> Fingerprint:
    return Fingerprint(**{**fp.components(), component: f"{fp.components()[component]}-new"})


def _statuses(url: str) -> dict[str, int]:
    with Store.open(url) as s:
        return s.count_entries()


def test_shipped_store_check_is_a_dry_run_then_marks_every_op(shipped: str, tmp_path: Path) -> None:
    with Store.open(shipped) as s:
        [old] = s.fingerprints().values()
        ops = {e.op for e in s.entries()}
    assert len(ops) > 1  # MoE configs and decode-op choices
    before = _statuses(shipped)
    fp_file = tmp_path / "new.json"
    fp_file.write_text(json.dumps(fingerprint_document(_upgraded(old))))
    base = ["drift", "check", "--db", shipped, "--fingerprint", str(fp_file)]
    dry = _mxdb(*base, "--json", "--out", str(tmp_path / "w.yaml"))
    assert dry.returncode == 1, dry.stderr
    doc = json.loads(dry.stdout)
    # the decided entries; the tuner's single-config records (imported, never dispatched) are
    # table-export material of their own fingerprint and stay as they are
    singles = before.get("imported", 0)
    assert singles > 0
    total = sum(before.values()) - singles
    assert doc["dry_run"] is True and doc["marked"] == 0 and doc["would_mark"] == total
    assert _statuses(shipped) == before  # nothing written
    assert {c["op"] for c in doc["decode_cases"]} == ops - {"fused_moe"}
    assert load_workload(tmp_path / "w.yaml").models  # the MoE part loads back as a workload
    text = _mxdb(*base)
    assert "would mark" in text.stdout and "pass --mark" in text.stdout
    marked = _mxdb(*base, "--mark", "--json")
    assert marked.returncode == 1, marked.stderr
    assert json.loads(marked.stdout)["marked"] == total
    assert _statuses(shipped) == {"stale": total, "imported": singles}
    again = _mxdb(*base, "--mark", "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["already_stale"] == total


def test_gpu_free_fingerprint_cannot_judge_gpu_entries(shipped: str, tmp_path: Path) -> None:
    cpu = Fingerprint(**{**collect().components(), "torch": "0.0-cpu", "triton": None})
    assert not has_gpu_facts(cpu)
    fp_file = tmp_path / "cpu.json"
    fp_file.write_text(json.dumps(fingerprint_document(cpu)))
    before = _statuses(shipped)
    out = _mxdb("drift", "check", "--db", shipped, "--fingerprint", str(fp_file), "--mark")
    assert out.returncode == 0, out.stderr
    assert "not judged" in out.stdout and "no GPU facts" in out.stdout
    assert _statuses(shipped) == before
    with Store.open(shipped) as s:
        report = check(s, cpu, mark=True)
    assert report["drifted"] == [] and report["marked"] == 0
    [cj] = report["cannot_judge"]
    judged = sum(n for status, n in before.items() if status != "imported")
    assert cj["device_name"] == "NVIDIA H200" and len(cj["entries"]) == judged


def test_offline_check_on_this_host_leaves_the_shipped_store_alone(shipped: str) -> None:
    out = _mxdb("drift", "check", "--db", shipped, "--offline", "--mark", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["marked"] == 0 and len(doc["cannot_judge"]) == 1
    assert "stale" not in _statuses(shipped)


def test_guard_skips_decode_entries(shipped: str) -> None:
    be = FakeBackend(noise=0.001)
    with Store.open(shipped) as s:
        s.put_fingerprint(be.fingerprint())
        report = guard(s, be, policy="device", max_shapes=4, reps=3)
    assert report["guards"] == 0  # no crash on the decode-op entries; none is the fake's


def _entry(fp: Fingerprint, config: KernelConfig, tokens: int = 16) -> Entry:
    s = SHAPE.with_tokens(tokens)
    return Entry(
        dtype=s.dtype, family=s.family, dims=s.dims(), tokens=tokens, routing_class="uniform",
        config=config.model_dump(), config_hash=config.hash, fingerprint_hash=fp.hash,
        status="verified", source="tune", speedup=1.1, noise_band=0.01, median_us=700.0,
    )  # fmt: skip


def test_reverify_with_the_fake_backend_through_the_cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'mxdb.sqlite'}"
    be = FakeBackend(noise=0.002, baseline=BASE)
    now = be.fingerprint()
    old = _upgraded(now, "torch")
    with Store.open(url) as s:
        s.put_fingerprint(old)
        good, bad, base = s.add_entries(
            [_entry(old, GOOD), _entry(old, BAD, tokens=17), _entry(old, BASE, tokens=18)]
        )
        assert check(s, now, mark=True)["marked"] == 3
    # the CLI's fake backend, with this test's FlagGems choice and noise
    monkeypatch.setattr(
        "mxdb.runtime.drift.make_backend", lambda name: FakeBackend(noise=0.002, baseline=BASE)
    )
    evidence = tmp_path / "reverify.json"
    runner = CliRunner()
    argv = ["drift", "reverify", "--db", url, "--backend", "fake", "--reps", "9"]
    res = runner.invoke(cli, [*argv, "--out", str(evidence), "--json"])
    assert res.exit_code == 1, res.output  # one rejected
    doc = json.loads(res.output)
    verdicts = {r["entry_id"]: r["verdict"] for r in doc["results"]}
    assert verdicts == {good: "verified", bad: "rejected", base: "baseline"}
    assert (doc["verified"], doc["rejected"], doc["baseline"]) == (1, 1, 1)
    saved = json.loads(evidence.read_text())
    assert saved["schema"] == "mxdb.reverify" and saved["fingerprint"] == now.hash
    row = next(r for r in saved["results"] if r["entry_id"] == good)
    assert len(row["samples_us"]["candidate"]) == 9 and row["speedup"] > 1 + row["noise_band"]
    with Store.open(url) as s:
        # the stale entries stay, naming their verdicts; the verdicts live in this environment
        for eid in (good, bad, base):
            e = s.get_entry(eid)
            assert e.status == "stale" and "re-measured in" in (e.stale_reason or "")
        new = {e.config_hash: e for e in s.entries(fingerprint_hash=now.hash)}
        assert new[GOOD.hash].status == "verified" and new[GOOD.hash].source == "reverify"
        assert new[BAD.hash].status == "rejected" and "noise band" in new[BAD.hash].stale_reason
        assert new[BASE.hash].status == "baseline"
        runs = {m.run_id for m in s.measurements()}
        run = new[GOOD.hash].evidence or "?"
        assert {f"{run}-{n}" for n in ("candidate", "baseline", "control-a", "control-b")} <= runs
        # the verified one is dispatched again in the new environment
        dec = Dispatcher(s, now).dispatch(SHAPE, "uniform")
        assert dec.entry_id == new[GOOD.hash].id
        # a fresh check counts the re-verified key as covered
        assert check(s, now)["workload"]["tokens"] == [17]
    # a second run measures nothing twice
    res = runner.invoke(cli, [*argv, "--json"])
    assert {r["verdict"] for r in json.loads(res.output)["results"]} == {"skipped"}
    # text output, and an entry that is not stale is refused
    res = runner.invoke(cli, [*argv, "--entry", str(new[GOOD.hash].id)])
    assert res.exit_code == 2 and "not stale" in res.output


class _DecodeBackend:
    """A decode backend whose fused implementation lost its lead on rms_norm."""

    name = "fake-decode"
    COST: ClassVar[dict[str, float]] = {"torch": 10.0, "fused": 5.0, "flaggems": 6.0}

    def __init__(self) -> None:
        self.rng = random.Random(0)

    def fingerprint(self) -> Fingerprint:  # pragma: no cover - reverify uses the MoE one
        raise AssertionError

    def impls(self, op: str) -> list[str]:
        return ["torch", "fused", "flaggems"]

    def time(self, case: DecodeCase, impls: Sequence[str], *, reps: int, seed: int) -> list[Any]:
        out = []
        for i in impls:
            cost = self.COST[i] * (2.0 if case.op == "rms_norm" and i == "fused" else 1.0)
            out.append(
                Timing(
                    "ok", tuple(cost * (1 + 0.001 * self.rng.random()) for _ in range(reps)), None
                )
            )
        return out

    def check(self, case: DecodeCase, impl: str, *, seed: int) -> Correctness:
        return Correctness(1e-3, 1e-3, 1e-2, 1e-2, True)


def test_reverify_decode_entries(tmp_path: Path) -> None:
    be = FakeBackend()
    now = be.fingerprint()
    old = _upgraded(now, "torch")
    url = f"sqlite:///{tmp_path / 'mxdb.sqlite'}"

    def dec(op: str, dims: dict[str, int]) -> Entry:
        cfg = {"impl": "fused"}
        from mxdb.configs import config_hash
        from mxdb.shapes import OpShape

        shape = OpShape(op, dims, 8, "bf16")
        return Entry(
            op=op, dtype="bf16", family=shape.family, dims={**dims, "tokens": 8}, tokens=8,
            config=cfg, config_hash=config_hash(cfg), fingerprint_hash=old.hash,
            status="verified", source="tune", speedup=2.0, noise_band=0.01, median_us=5.0,
        )  # fmt: skip

    with Store.open(url) as s:
        s.put_fingerprint(old)
        still, lost = s.add_entries([dec("swiglu", {"n": 3072}), dec("rms_norm", {"n": 1024})])
        check(s, now, mark=True)
        skipped = reverify(s, be, reps=5)
        assert {r["verdict"] for r in skipped["results"]} == {"skipped"}
        report = reverify(s, be, decode_backend=_DecodeBackend(), reps=5)
        rows = {r["entry_id"]: r for r in report["results"]}
        assert rows[still]["verdict"] == "verified"
        assert rows[lost]["verdict"] == "rejected" and rows[lost]["winner"] == "flaggems"
        winner = s.get_entry(rows[lost]["winner_entry_id"])
        assert winner.status == "verified" and winner.config == {"impl": "flaggems"}
        assert winner.fingerprint_hash == now.hash
