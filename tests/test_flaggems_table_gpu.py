"""GPU: the real FlagGems 5.0.2 reads the table ``mxdb export --format flaggems --install`` writes.

Writes into the installed flag_gems package (``<flag_gems>/utils/configs/fused_moe_config.yaml``)
and puts back exactly what was there before (or nothing), backups included.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from mxdb.cli.app import cli
from mxdb.configs import GemmConfig, KernelConfig
from mxdb.fingerprint import kernel_source_hash
from mxdb.interop import flaggems
from mxdb.models import Entry, Fingerprint
from mxdb.shapes import MoEShape
from mxdb.store import Store

pytestmark = pytest.mark.gpu

E, H, N, K = 8, 4096, 14336, 2
ROWS = {
    4: GemmConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4),
    256: GemmConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3),
}
OTHER_DEVICE = """\
_FALLBACK:
  NVIDIA_H800: NVIDIA_H100_80GB_HBM3
NVIDIA_H100_80GB_HBM3:
  "8,14336,None,0,0":
    "1": [16,64,128,1,4,3]
"""


@pytest.fixture()
def fused_moe() -> Iterator[Any]:
    """FlagGems' fused_moe module, unhooked, with its table restored afterwards."""
    import mxdb

    mxdb.uninstall()  # mxdb's runtime hook would answer try_get_optimal_moe_config itself
    from flag_gems.fused import fused_moe as module

    target = flaggems.installed_path()
    flaggems_reads = Path(
        os.path.normpath(
            os.path.join(
                os.path.dirname(module.__file__), "..", "utils", "configs", "fused_moe_config.yaml"
            )
        )
    )
    assert target.resolve() == flaggems_reads.resolve()
    before = target.read_bytes() if target.exists() else None
    existing_backups = set(target.parent.glob(f"{target.name}.mxdb-backup-*"))
    try:
        yield module
    finally:
        if before is None:
            target.unlink(missing_ok=True)
        else:
            target.write_bytes(before)
        for backup in set(target.parent.glob(f"{target.name}.mxdb-backup-*")) - existing_backups:
            backup.unlink()
        module.get_embedded_moe_configs.cache_clear()
        module._get_device_name.cache_clear()


def test_flaggems_reads_the_installed_merged_table(fused_moe: Any, tmp_path: Path) -> None:
    import torch

    device = torch.cuda.get_device_name(0)
    fp = Fingerprint(vendor="nvidia", device_name=device, triton="gpu-test")
    db = f"sqlite:///{tmp_path / 'gpu.sqlite'}"
    store = Store.open(db)
    try:
        store.put_fingerprint(fp)
        entries = []
        for m, gemm in ROWS.items():
            shape = MoEShape(E, H, N, K, m, "bf16")
            cfg = KernelConfig.uniform(gemm)
            entries.append(
                Entry(
                    dtype="bf16",
                    family=shape.family,
                    dims=shape.dims(),
                    tokens=m,
                    config=cfg.model_dump(),
                    config_hash=cfg.hash,
                    fingerprint_hash=fp.hash,
                    device_name=device,
                    status="verified",
                    source="tune",
                    speedup=1.05,
                )
            )
        store.add_entries(entries)
    finally:
        store.close()

    target = flaggems.installed_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(OTHER_DEVICE)  # what another table left there: kept by the merge
    kernel_before = kernel_source_hash()
    result = CliRunner().invoke(
        cli,
        ["export", "--format", "flaggems", "--fingerprint", fp.hash, "--install", "--db", db,
         "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["files"] == [str(target)] and report["backup"]
    assert kernel_source_hash() == kernel_before  # the host's entries stay valid

    fused_moe.get_embedded_moe_configs.cache_clear()
    fused_moe._get_device_name.cache_clear()
    tables, fallback = fused_moe.get_embedded_moe_configs()
    assert fallback == {"NVIDIA_H800": "NVIDIA_H100_80GB_HBM3"}
    assert "NVIDIA_H100_80GB_HBM3" in tables
    name = fused_moe._get_device_name()
    assert name == flaggems.device_key(device)
    assert name in tables and f"{E},{N},None,0,0" in tables[name]

    w1, w2 = (E, 2 * N, H), (E, H, N)
    for m, gemm in ROWS.items():
        got = fused_moe.try_get_optimal_moe_config(w1, w2, K, None, m, E)
        assert got == gemm.to_triton(), (m, got)
    # the nearest M, as FlagGems picks it
    assert fused_moe.try_get_optimal_moe_config(w1, w2, K, None, 5, E) == ROWS[4].to_triton()
    assert fused_moe.try_get_optimal_moe_config(w1, w2, K, None, 300, E) == ROWS[256].to_triton()
    # the file is a plain mapping FlagGems' loader accepts
    assert isinstance(yaml.safe_load(target.read_text()), dict)
