"""mxdb.kernels.MoELayer on a GPU: correctness, identity with FlagGems, no steady-path allocation."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.gpu

SHAPE = (16, 512, 256, 4)  # E, H, I, k: small enough for a fast float32 reference


def _setup(seed: int = 0) -> tuple[Any, Any, Any]:
    torch = pytest.importorskip("torch")
    from mxdb.kernels.reference import make_weights

    from mxdb.shapes import MoEShape

    e, h, i, k = SHAPE
    w1, w2 = make_weights(MoEShape(e, h, i, k, 1, "bf16"), seed, "cuda")
    return torch, w1, w2


def _inputs(torch: Any, m: int, kind: str, seed: int) -> tuple[Any, Any, Any]:
    e, h, _, k = SHAPE
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn((m, h), generator=g, device="cuda").to(torch.bfloat16)
    tw = torch.softmax(torch.randn((m, k), generator=g, device="cuda"), -1).contiguous()
    if kind == "uniform":
        ids = torch.rand((m, e), generator=g, device="cuda").topk(k, -1).indices
    elif kind == "one_expert":  # every token routes to expert 3 (and k-1 others)
        rest = torch.rand((m, e - 1), generator=g, device="cuda").topk(k - 1, -1).indices
        rest = rest + (rest >= 3).long()
        ids = torch.cat([torch.full((m, 1), 3, device="cuda", dtype=torch.long), rest], 1)
    else:  # "few_experts": experts k.. get no token
        ids = torch.arange(k, device="cuda").repeat(m, 1)
    return x, tw, ids.to(torch.int32).contiguous()


@pytest.mark.parametrize("m", [1, 2, 5, 16, 37, 256])
@pytest.mark.parametrize("kind", ["uniform", "one_expert", "few_experts"])
def test_layer_matches_reference_and_fused_experts_impl(m: int, kind: str) -> None:
    torch, w1, w2 = _setup()
    import flag_gems.fused.fused_moe as fm
    from mxdb.kernels.layer import MoELayer
    from mxdb.kernels.reference import compare, moe_reference

    layer = MoELayer(w1, w2, SHAPE[3])
    for seed in (1, 2):  # the second call at M takes the steady path
        x, tw, ids = _inputs(torch, m, kind, seed + 10 * m)
        out = layer(x, tw, ids).clone()
        assert compare(out, moe_reference(x, w1, w2, tw, ids), "bf16").passed
        assert torch.equal(out, fm.fused_experts_impl(x, w1, w2, tw, ids))
    assert not layer.record_errors
    assert layer.launches(m) in (4, 9, 10, 11)


def test_steady_path_allocates_nothing_and_is_capturable() -> None:
    torch, w1, w2 = _setup()
    from mxdb.kernels.layer import MoELayer

    layer = MoELayer(w1, w2, SHAPE[3])
    x, tw, ids = _inputs(torch, 24, "uniform", 3)
    ref = layer(x, tw, ids).clone()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(5):
        layer(x, tw, ids)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    from mxdb.kernels.timing import capture

    out = torch.empty_like(ref)
    g = capture(lambda: layer(x, tw, ids, out), 2)
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref)


def test_graphs_mode_and_dispatch_wiring() -> None:
    torch, w1, w2 = _setup()
    from mxdb.kernels.layer import MoELayer

    from mxdb.configs import GemmConfig, KernelConfig
    from mxdb.dispatcher import dispatch_config_for

    g1 = GemmConfig(block_m=16, block_n=64, block_k=64, group_m=1, num_warps=4, num_stages=3)
    g2 = GemmConfig(block_m=32, block_n=64, block_k=64, group_m=1, num_warps=4, num_stages=3)
    cfg = KernelConfig(gemm1=g1, gemm2=g2, align_block=32)
    asked: list[Any] = []

    class D:
        def dispatch(self, shape: Any, routing: Any = None) -> Any:
            asked.append(shape.tokens)
            return type("Answer", (), {"config": cfg})()

    eager = MoELayer(w1, w2, SHAPE[3], dispatch_config_for(eager_shape(w1), D()))
    graphed = MoELayer(w1, w2, SHAPE[3], lambda m: cfg, graphs=True)
    for seed in range(3):
        x, tw, ids = _inputs(torch, 40, "uniform", seed)
        a = eager(x, tw, ids).clone()
        b = graphed(x, tw, ids).clone()
        assert torch.equal(a, b)
    assert asked == [40]
    assert eager.configs[40] == cfg


def eager_shape(w1: Any) -> Any:
    from mxdb.shapes import MoEShape

    e, two_i, h = w1.shape
    return MoEShape(e, h, two_i // 2, SHAPE[3], 1, "bf16")
