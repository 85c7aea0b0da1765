"""The FlagGems hook on real FlagGems calls (GPU): identical results to FlagGems with the config.

Each test computes FlagGems' own output with its config lookup fixed to the stored config,
then the same call through the installed hook (plain, through FlagGems' out-of-place entry
point, and with every call a timed healing sample), and requires bit-identical tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mxdb import Dispatcher, KernelConfig, MoEShape
from mxdb.configs import GemmConfig
from mxdb.models import Entry, Fingerprint
from mxdb.runtime.healing import HealingOptions
from mxdb.store import Store

FP = Fingerprint(vendor="test", device_name="gpu")
CFG = KernelConfig.uniform(
    GemmConfig(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=3)
)
E, H, I, K = 8, 512, 256, 2  # noqa: E741


def _setup(tmp_path: Path, tokens: int) -> tuple[Any, Any, tuple[Any, ...], Store, Any]:
    torch = pytest.importorskip("torch")
    fm = pytest.importorskip("flag_gems.fused.fused_moe")
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, generator=g)
    w1 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(tokens)])
    tw = torch.softmax(torch.randn(tokens, K, device="cuda", generator=g), -1)
    shape = MoEShape(E, H, I, K, tokens, "bf16")
    store = Store.open(f"sqlite:///{tmp_path / 'db.sqlite'}")
    store.put_fingerprint(FP)
    store.add_entries([Entry(
        dtype="bf16", family=shape.family, dims=shape.dims(), tokens=tokens,
        routing_class="uniform", config=CFG.model_dump(), config_hash=CFG.hash,
        fingerprint_hash=FP.hash, status="verified", source="tune", speedup=1.1,
        median_us=50.0,
    )])  # fmt: skip
    args = (x, w1, w2, tw, ids.to(torch.int32))
    orig_cfg = fm.try_get_optimal_moe_config
    fm.try_get_optimal_moe_config = lambda *a, **kw: CFG.gemm1.to_triton()
    try:
        expected = fm.fused_experts_impl(*args)
    finally:
        fm.try_get_optimal_moe_config = orig_cfg
    torch.cuda.synchronize()
    return torch, fm, args, store, expected


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 256])
def test_hook_matches_flaggems_with_same_config(tmp_path: Path, tokens: int) -> None:
    import mxdb

    torch, fm, args, store, expected = _setup(tmp_path, tokens)
    orig_cfg = fm.try_get_optimal_moe_config
    hook = mxdb.install(Dispatcher(store, FP), monitor_every=2)
    try:
        got: Any = [fm.fused_experts_impl(*args) for _ in range(3)][-1]
        outplace = fm.outplace_fused_experts(*args)
        assert hook.stats()["dispatched"] == 4
        assert hook.stats()["fallback"] == 0
    finally:
        mxdb.uninstall()
    assert fm.try_get_optimal_moe_config is orig_cfg
    assert torch.equal(got, expected)
    assert torch.equal(outplace, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [16, 256])
def test_healing_samples_leave_results_identical(tmp_path: Path, tokens: int) -> None:
    import mxdb

    torch, fm, args, store, expected = _setup(tmp_path, tokens)
    hook = mxdb.install(
        Dispatcher(store, FP), monitor_every=0, healing=HealingOptions(sample_every=1)
    )
    try:
        outs = [fm.fused_experts_impl(*args) for _ in range(12)]
        torch.cuda.synchronize()
        fm.fused_experts_impl(*args)  # drains the timings of the calls before
        stats = hook.stats()
    finally:
        mxdb.uninstall()
    assert stats["healing_samples"] == 13 and stats["dispatched"] == 13
    assert hook.healer is not None and hook.healer.state(hook.healer.keys()[0])["samples"] >= 12
    for out in outs:
        assert torch.equal(out, expected)
