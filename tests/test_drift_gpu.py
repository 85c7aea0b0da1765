"""``mxdb drift reverify`` on the GPU: stale entries re-measured with the real backend."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from mxdb import KernelConfig, MoEShape
from mxdb.cli.app import cli
from mxdb.configs import GemmConfig
from mxdb.models import Entry, Fingerprint
from mxdb.store import Store

pytestmark = pytest.mark.gpu

SHAPE = MoEShape(experts=8, hidden=512, intermediate=256, topk=2, tokens=16, dtype="bf16")
OLD = Fingerprint(vendor="nvidia", device_name="NVIDIA OLD", triton="0.0")
CONFIGS = [
    KernelConfig.uniform(GemmConfig(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=3)),
    KernelConfig(
        gemm1=GemmConfig(block_m=16, block_n=128, block_k=64, num_warps=4, num_stages=3),
        gemm2=GemmConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=2),
        align_block=16,
    ),
]


def _stale(c: KernelConfig) -> Entry:
    return Entry(
        dtype="bf16", family=SHAPE.family, dims=SHAPE.dims(), tokens=16,
        config=c.model_dump(), config_hash=c.hash, fingerprint_hash=OLD.hash,
        status="stale", source="tune", speedup=1.2, noise_band=0.01,
        median_us=20.0, stale_reason="environment changed",
    )  # fmt: skip


def test_reverify_on_the_gpu(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    with Store.open(url) as s:
        s.put_fingerprint(OLD)
        ids = s.add_entries([_stale(c) for c in CONFIGS])
    out = tmp_path / "reverify.json"
    res = CliRunner().invoke(
        cli,
        ["drift", "reverify", "--db", url, "--backend", "gpu", "--reps", "7", "--out", str(out),
         "--json"],
    )  # fmt: skip
    assert res.exit_code in (0, 1), res.output
    doc = json.loads(res.output)
    rows = {r["entry_id"]: r for r in doc["results"]}
    assert set(rows) == set(ids)
    for r in rows.values():
        assert r["verdict"] in ("verified", "baseline", "rejected"), r
        assert len(r["samples_us"]["candidate"]) == 7 and r["max_abs_err"] is not None
        print(r["entry_id"], r["verdict"], r["reason"])
    saved = json.loads(out.read_text())
    assert saved["fingerprint"] == doc["fingerprint"]
    with Store.open(url) as s:
        new = s.entries(fingerprint_hash=doc["fingerprint"], source="reverify")
        assert len(new) == 2
        assert all(s.get_entry(i).status == "stale" for i in ids)
