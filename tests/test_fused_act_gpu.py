"""GPU tests of the ``fused_act`` implementation: alignment and GEMM1, layer, recorded layer, hook.

Every output is poisoned with NaN before the run and compared with the float32 reference; the
one-pass alignment is compared entry by entry with a host-side restatement.
"""

from __future__ import annotations

import pytest

from mxdb.configs import KernelConfig
from mxdb.shapes import MoEShape
from tests.test_kernels_gpu import _gemm, _run_case

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def torch(cuda_torch):
    return cuda_torch


def _fused(g1, g2=None, align=None) -> KernelConfig:
    g2 = g2 or g1
    return KernelConfig(
        gemm1=g1, gemm2=g2, align_block=align or max(g1.block_m, g2.block_m), impl="fused_act"
    )


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("tokens", [1, 3, 37, 200, 1100])
def test_fused_act_layer_matches_reference(torch, dtype, tokens):
    shape = MoEShape(16, 1024, 768, 4, tokens=tokens, dtype=dtype)
    for config in (
        _fused(_gemm(16, 64, 64)),
        _fused(_gemm(32, 32, 128), _gemm(64, 128, 64), 64),
    ):
        p, rep, out, _ = _run_case(torch, shape, config, seed=tokens)
        assert bool(torch.isfinite(out).all()), "some output rows were never written"
        assert rep.passed, (config.short(), rep)
        # 1100 x 4 slots stay within one pass; the cache of GEMM1's 2I outputs is gone
        assert p.act1 is not None and p.cache1.numel() == 0
        assert (p.one_pass is not None) == (not p.naive)


def test_fused_act_staged_alignment_beyond_one_pass(torch):
    from mxdb.kernels.fused_act import ONE_PASS_MAX_SLOTS

    tokens = ONE_PASS_MAX_SLOTS // 2 + 5  # k = 2: just past the one-pass limit
    shape = MoEShape(8, 1024, 512, 2, tokens=tokens, dtype="bf16")
    p, rep, _, _ = _run_case(torch, shape, _fused(_gemm(64, 64, 64), _gemm(32, 64, 64), 64), seed=2)
    assert p.one_pass is None and not p.naive
    assert rep.passed, rep


def test_one_pass_alignment_matches_host_restatement(torch):
    from mxdb.kernels.fused_act import AlignLaunch
    from mxdb.kernels.pipeline import padded_length

    gen = torch.Generator(device="cuda").manual_seed(11)
    for tokens, experts, k, align, bm1, bm2 in [
        (1, 8, 2, 16, 16, 16),
        (13, 128, 8, 64, 16, 64),
        (300, 64, 6, 128, 64, 32),
        (1024, 8, 2, 64, 64, 64),
    ]:
        ids = torch.rand((tokens, experts), generator=gen, device="cuda").topk(k).indices
        ids = ids.to(torch.int32).contiguous()
        slots = tokens * k
        n = padded_length(slots, experts, align)
        sids = torch.full((n,), -1, dtype=torch.int32, device="cuda")
        t1 = torch.full((n // bm1,), -1, dtype=torch.int32, device="cuda")
        t2 = torch.full((n // bm2,), -1, dtype=torch.int32, device="cuda")
        ntpp = torch.zeros(1, dtype=torch.int32, device="cuda")
        AlignLaunch(slots, experts, align, bm1, bm2).launch(ids, sids, t1, t2, ntpp)
        flat = ids.flatten().tolist()
        want_s, want_1, want_2 = [], [], []
        for e in range(experts):
            mine = [j for j, v in enumerate(flat) if v == e]
            span = -(-len(mine) // align) * align
            want_s += mine + [slots] * (span - len(mine))
            want_1 += [e] * (span // bm1)
            want_2 += [e] * (span // bm2)
        got = int(ntpp.item())
        assert got == len(want_s)
        assert sids[:got].tolist() == want_s
        assert t1[: got // bm1].tolist() == want_1
        assert t2[: got // bm2].tolist() == want_2


def test_fused_act_skewed_and_empty_experts(torch):
    shape = MoEShape(16, 1024, 768, 4, tokens=45, dtype="bf16")
    gen = torch.Generator(device="cuda").manual_seed(3)
    others = torch.rand((45, 16), generator=gen, device="cuda")
    others[:, 7] = -1.0
    ids = torch.cat(
        [torch.full((45, 1), 7, device="cuda"), others[:, :6].topk(3, dim=-1).indices], dim=1
    ).to(torch.int32)
    for naive in (False, True):
        _, rep, _, _ = _run_case(torch, shape, _fused(_gemm(16, 64, 64)), ids, seed=5, naive=naive)
        assert rep.passed, (naive, rep)


def test_fused_act_int64_ids_and_sparse_mode(torch):
    shape = MoEShape(128, 1024, 768, 8, tokens=2, dtype="bf16")  # 16 slots x 4 <= 128: naive
    gen = torch.Generator(device="cuda").manual_seed(9)
    ids = torch.rand((2, 128), generator=gen, device="cuda").topk(8).indices  # int64
    p, rep, _, _ = _run_case(torch, shape, _fused(_gemm(16, 64, 128)), ids, seed=9)
    assert p.naive
    assert rep.passed, rep


def test_fused_act_layer_records_and_replays(torch):
    """MoELayer's recorded plan (and a CUDA graph of it) gives the pipeline's output."""
    from mxdb.kernels.layer import MoELayer
    from mxdb.kernels.reference import compare, make_inputs, moe_reference

    shape = MoEShape(16, 1024, 768, 4, tokens=24, dtype="bf16")
    inp = make_inputs(shape, 21)
    config = _fused(_gemm(16, 64, 64))
    layer = MoELayer(inp.w1, inp.w2, shape.topk, lambda _m: config)
    ref = moe_reference(inp.x, inp.w1, inp.w2, inp.topk_weights, inp.topk_ids)
    outs = [layer(inp.x, inp.topk_weights, inp.topk_ids).clone() for _ in range(3)]
    assert not layer.record_errors, layer.record_errors
    for out in outs:
        assert compare(out, ref, shape.dtype).passed
    assert torch.equal(outs[0], outs[2])
    graph = torch.cuda.CUDAGraph()
    static = layer(inp.x, inp.topk_weights, inp.topk_ids)
    with torch.cuda.graph(graph):
        static = layer(inp.x, inp.topk_weights, inp.topk_ids)
    static.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert compare(static, ref, shape.dtype).passed


def test_fused_act_compiles_in_workers(torch):
    from mxdb.kernels.compile import CompilePool, combine, specs_for

    shape = MoEShape(16, 1024, 768, 4, tokens=37, dtype="bf16")
    ok = _fused(_gemm(16, 64, 64))
    # a gate and an up tile of 256 x 256 at 4 stages exceed the shared memory of any GPU
    too_big = _fused(_gemm(64, 256, 256, s=4))
    pool = CompilePool(workers=2)
    try:
        results = pool.run([*specs_for(shape, ok), *specs_for(shape, too_big)])
    finally:
        pool.close()
    assert (
        specs_for(shape, ok)[0].impl == "fused_act" and specs_for(shape, ok)[1].impl == "flaggems"
    )
    assert combine(results[:2])[0] == "ok"
    assert combine(results[2:])[0] == "oor", results[2:]
