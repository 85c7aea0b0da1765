"""The store commands through the real CLI (subprocesses): dispatch, db info, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mxdb import GemmConfig, KernelConfig, MoEShape
from mxdb.models import Entry, Fingerprint
from mxdb.store import Store

FP = Fingerprint(
    vendor="nvidia",
    device_name="NVIDIA H200",
    arch="sm_90",
    warp_size=32,
    smem_per_block=232448,
    triton="3.6.0",
    flag_gems="5.0.2",
    driver="580.159.04",
)
SHAPE = ["--experts", "8", "--hidden", "4096", "--intermediate", "14336", "--topk", "2"]


def mxdb_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mxdb", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture()
def seeded(tmp_path: Path) -> tuple[str, Path]:
    url = f"sqlite:///{tmp_path / 'mxdb.sqlite'}"
    cfg = KernelConfig.uniform(GemmConfig(block_m=16, block_n=128, block_k=64, num_stages=3))
    with Store.open(url) as store:
        store.put_fingerprint(FP)
        for m, rc in ((4, "uniform"), (64, "uniform"), (64, "hot")):
            s = MoEShape(8, 4096, 14336, 2, m, "bf16")
            store.add_entries(
                [
                    Entry(
                        dtype="bf16",
                        family=s.family,
                        dims=s.dims(),
                        tokens=m,
                        routing_class=rc,
                        config=cfg.model_dump(),
                        config_hash=cfg.hash,
                        fingerprint_hash=FP.hash,
                        device_name=FP.device_name,
                        status="verified",
                        source="tune",
                        speedup=1.05,
                        confidence=1.0,
                        # held-out instances won at M and at 1.5x M (neighbour answers)
                        validation=[
                            {
                                "comparison": "heldout-1",
                                "tokens": m,
                                "routing_class": rc,
                                "won": True,
                            },
                            {
                                "comparison": f"tokens-{m * 3 // 2}",
                                "tokens": m * 3 // 2,
                                "routing_class": rc,
                                "won": True,
                            },
                        ],
                    )
                ]
            )
    fp_file = tmp_path / "fingerprint.json"
    fp_file.write_text(FP.model_dump_json())
    return url, fp_file


def test_dispatch_json_has_the_documented_fields(seeded: tuple[str, Path]) -> None:
    url, fp = seeded
    out = mxdb_cli(
        "dispatch", *SHAPE, "--tokens", "4", "--db", url, "--fingerprint", str(fp), "--json"
    )
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert {"config", "level", "confidence", "reason"} <= set(d)
    assert (d["level"], d["reason"], d["confidence"]) == ("exact", "exact_match", 1.0)
    assert d["triton_config"]["gemm1"]["BLOCK_SIZE_N"] == 128
    human = mxdb_cli("dispatch", *SHAPE, "--tokens", "5", "--db", url, "--fingerprint", str(fp))
    assert human.returncode == 0 and "neighbour" in human.stdout and "M16/N128/K64" in human.stdout


def test_dispatch_from_a_routing_trace(seeded: tuple[str, Path], tmp_path: Path) -> None:
    url, fp = seeded
    trace = tmp_path / "hot.json"
    trace.write_text(json.dumps([[0, 1 + i % 7] for i in range(64)]))  # expert 0 in every token
    out = mxdb_cli(
        "dispatch", *SHAPE, "--tokens", "64", "--db", url, "--fingerprint", str(fp),
        "--routing-trace", str(trace), "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["routing_class"] == "hot" and d["reason"] == "exact_match"
    assert d["routing_features"]["max_share"] == pytest.approx(0.5)  # 64 of 128 slots


def test_dispatch_without_matching_fingerprint_falls_back(seeded: tuple[str, Path]) -> None:
    url, _ = seeded
    out = mxdb_cli("dispatch", *SHAPE, "--tokens", "4", "--db", url, "--json")
    assert out.returncode == 0
    d = json.loads(out.stdout)
    assert (d["level"], d["config"], d["reason"]) == ("fallback", None, "fingerprint_mismatch")


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--tokens", "0"], "tokens must be a positive integer"),
        (["--tokens", "4", "--dtype", "int8"], "Invalid value for '--dtype'"),
        (["--tokens", "4", "--routing-class", "zipf"], "Invalid value for '--routing-class'"),
        (
            ["--tokens", "4", "--routing-class", "hot", "--routing-trace", "x.json"],
            "either --routing-trace or --routing-class",
        ),
        (["--tokens", "4", "--routing-trace", "missing.json"], "missing.json"),
    ],
)
def test_dispatch_usage_errors_exit_2(
    seeded: tuple[str, Path], extra: list[str], needle: str
) -> None:
    url, _ = seeded
    out = mxdb_cli("dispatch", *SHAPE, *extra, "--db", url)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert needle in out.stderr


def test_db_info(seeded: tuple[str, Path]) -> None:
    url, _ = seeded
    out = mxdb_cli("db", "info", "--db", url, "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["entries"] == 3 and info["entries_by_status"] == {"verified": 3}
    assert info["revision"] == "0006" and info["dialect"] == "sqlite"


def test_mxdb_db_variable_is_the_default_store(seeded: tuple[str, Path]) -> None:
    url, _ = seeded
    out = mxdb_cli("db", "info", "--json", env={"MXDB_DB": url})
    assert json.loads(out.stdout)["entries"] == 3


def test_corrupt_database_is_refused_and_left_alone(tmp_path: Path) -> None:
    bad = tmp_path / "notes.sqlite"
    bad.write_bytes(b"these are my notes, not a database\n" * 100)
    before = bad.read_bytes()
    out = mxdb_cli("dispatch", *SHAPE, "--tokens", "4", "--db", f"sqlite:///{bad}")
    assert out.returncode == 1
    assert "mxdb: error:" in out.stderr and str(bad) in out.stderr
    assert bad.read_bytes() == before
