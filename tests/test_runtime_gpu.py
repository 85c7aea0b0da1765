"""The FlagGems hook on real FlagGems calls (GPU): identical results to FlagGems with the config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mxdb import Dispatcher, KernelConfig, MoEShape
from mxdb.configs import GemmConfig
from mxdb.models import Entry, Fingerprint
from mxdb.store import Store

FP = Fingerprint(vendor="test", device_name="gpu")
CFG = KernelConfig.uniform(
    GemmConfig(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=3)
)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 256])
def test_hook_matches_flaggems_with_same_config(tmp_path: Path, tokens: int) -> None:
    torch = pytest.importorskip("torch")
    fm = pytest.importorskip("flag_gems.fused.fused_moe")
    import mxdb

    e, h, i, k = 8, 512, 256, 2
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16, generator=g)
    w1 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
    ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(tokens)])
    tw = torch.softmax(torch.randn(tokens, k, device="cuda", generator=g), -1)
    shape = MoEShape(e, h, i, k, tokens, "bf16")
    store = Store.open(f"sqlite:///{tmp_path / 'db.sqlite'}")
    store.put_fingerprint(FP)
    store.add_entries([Entry(
        dtype="bf16", family=shape.family, dims=shape.dims(), tokens=tokens,
        routing_class="uniform", config=CFG.model_dump(), config_hash=CFG.hash,
        fingerprint_hash=FP.hash, status="verified", source="tune", speedup=1.1,
    )])  # fmt: skip
    orig_cfg = fm.try_get_optimal_moe_config
    fm.try_get_optimal_moe_config = lambda *a, **kw: CFG.gemm1.to_triton()
    try:
        expected = fm.fused_experts_impl(x, w1, w2, tw, ids)
    finally:
        fm.try_get_optimal_moe_config = orig_cfg
    hook = mxdb.install(Dispatcher(store, FP), monitor_every=2)
    try:
        got: Any = [fm.fused_experts_impl(x, w1, w2, tw, ids) for _ in range(3)][-1]
        assert hook.stats()["dispatched"] == 3
    finally:
        mxdb.uninstall()
    assert fm.try_get_optimal_moe_config is orig_cfg
    assert torch.equal(got, expected)
