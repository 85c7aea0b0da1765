"""GPU tests of mxdb.kernels: the pipeline against the float32 reference and FlagGems itself.

Every check draws fresh random inputs and poisons the output with NaN before the run.
"""

from __future__ import annotations

import pytest

from mxdb.configs import GemmConfig, KernelConfig
from mxdb.shapes import MoEShape

pytestmark = pytest.mark.gpu


def _gemm(m: int, n: int, k: int, g: int = 1, w: int = 4, s: int = 3) -> GemmConfig:
    return GemmConfig(block_m=m, block_n=n, block_k=k, group_m=g, num_warps=w, num_stages=s)


@pytest.fixture(scope="module")
def torch(cuda_torch):
    return cuda_torch


def _run_case(torch, shape, config, topk_ids=None, seed=0, naive=None):
    from mxdb.kernels.pipeline import MoEPipeline
    from mxdb.kernels.reference import compare, make_inputs, moe_reference

    inp = make_inputs(shape, seed, topk_ids)
    p = MoEPipeline(shape, config, inp.w1, inp.w2, naive=naive)
    out = torch.full_like(p.out, float("nan"))
    p(inp.x, inp.topk_weights, inp.topk_ids, out=out)
    ref = moe_reference(inp.x, inp.w1, inp.w2, inp.topk_weights, inp.topk_ids)
    rep = compare(out, ref, shape.dtype)
    return p, rep, out, inp


SMALL = (16, 1024, 768, 4)  # E, H, I, k


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("tokens", [1, 3, 37, 200])
def test_pipeline_matches_reference_uniform_routing(torch, dtype, tokens):
    shape = MoEShape(*SMALL, tokens=tokens, dtype=dtype)
    config = KernelConfig.uniform(_gemm(16, 64, 64))
    for seed in (0, 1):
        _, rep, out, _ = _run_case(torch, shape, config, seed=seed + tokens)
        assert bool(torch.isfinite(out).all()), "some output rows were never written"
        assert rep.passed, rep


def test_pipeline_empty_experts_and_one_hot_expert(torch):
    shape = MoEShape(*SMALL, tokens=29, dtype="bf16")
    gen = torch.Generator(device="cuda").manual_seed(3)
    # only experts 0..3 receive tokens: 12 of 16 experts are empty
    scores = torch.rand((29, 4), generator=gen, device="cuda")
    ids = scores.argsort(dim=-1).to(torch.int32)
    config = KernelConfig.uniform(_gemm(32, 64, 64))
    p, rep, _, _ = _run_case(torch, shape, config, ids, seed=4)
    assert not p.naive
    assert rep.passed, rep
    # every token routes to expert 7 (plus three others)
    others = torch.rand((29, 16), generator=gen, device="cuda")
    others[:, 7] = -1.0
    ids = torch.cat(
        [torch.full((29, 1), 7, device="cuda"), others.topk(3, dim=-1).indices], dim=1
    ).to(torch.int32)
    _, rep, _, _ = _run_case(torch, shape, config, ids, seed=5)
    assert rep.passed, rep


def test_pipeline_all_tokens_on_one_expert(torch):
    shape = MoEShape(8, 1024, 768, 1, tokens=45, dtype="bf16")
    ids = torch.full((45, 1), 5, dtype=torch.int32, device="cuda")
    for config in (
        KernelConfig.uniform(_gemm(16, 64, 64)),
        KernelConfig(gemm1=_gemm(16, 128, 64), gemm2=_gemm(64, 64, 128), align_block=64),
    ):
        _, rep, _, _ = _run_case(torch, shape, config, ids, seed=6)
        assert rep.passed, (config.short(), rep)


@pytest.mark.parametrize("tokens", [1, 3, 37, 130])
@pytest.mark.parametrize(
    "gemm1,gemm2,align",
    [
        ((16, 64, 64), (32, 64, 64), 64),
        ((64, 128, 64), (16, 64, 128), 64),
        ((16, 32, 128), (16, 128, 64), 128),
    ],
)
def test_split_configs_with_larger_alignment(torch, tokens, gemm1, gemm2, align):
    shape = MoEShape(*SMALL, tokens=tokens, dtype="bf16")
    config = KernelConfig(gemm1=_gemm(*gemm1), gemm2=_gemm(*gemm2), align_block=align)
    # force the aligned path even for sparse batches, where FlagGems would skip alignment
    p, rep, out, _ = _run_case(torch, shape, config, seed=tokens, naive=False)
    assert bool(torch.isfinite(out).all())
    assert rep.passed, (config.short(), rep)
    assert p.g1.em % align == 0 and p.g1.em >= tokens * shape.topk


@pytest.mark.parametrize(
    "shape,gemm",
    [
        (MoEShape(16, 1024, 768, 4, tokens=37, dtype="bf16"), (16, 64, 64, 1, 4, 3)),
        (MoEShape(16, 1024, 768, 4, tokens=1, dtype="bf16"), (16, 64, 128, 1, 4, 2)),  # naive
        (MoEShape(16, 1024, 768, 4, tokens=96, dtype="fp16"), (64, 128, 64, 8, 4, 3)),
        (MoEShape(8, 2048, 1408, 2, tokens=5, dtype="bf16"), (32, 64, 64, 1, 4, 4)),
    ],
)
def test_identical_to_flaggems_fused_experts_impl(torch, monkeypatch, shape, gemm):
    import flag_gems.fused.fused_moe as fm
    from mxdb.kernels.pipeline import MoEPipeline
    from mxdb.kernels.reference import make_inputs

    g = _gemm(*gemm[:3], g=gemm[3], w=gemm[4], s=gemm[5])
    monkeypatch.setattr(fm, "try_get_optimal_moe_config", lambda *a, **k: g.to_triton())
    inp = make_inputs(shape, 11)
    p = MoEPipeline(shape, KernelConfig.uniform(g), inp.w1, inp.w2)
    ours = p(inp.x, inp.topk_weights, inp.topk_ids).clone()
    theirs = fm.fused_experts_impl(inp.x, inp.w1, inp.w2, inp.topk_weights, inp.topk_ids)
    assert torch.equal(ours, theirs), float((ours.float() - theirs.float()).abs().max())


def test_graph_and_eager_timing(torch):
    from mxdb.kernels.pipeline import MoEPipeline
    from mxdb.kernels.reference import make_inputs
    from mxdb.kernels.timing import time_interleaved

    shape = MoEShape(*SMALL, tokens=8, dtype="bf16")
    inp = make_inputs(shape, 2)
    configs = [
        KernelConfig.uniform(_gemm(16, 64, 64)),
        KernelConfig(gemm1=_gemm(16, 64, 64), gemm2=_gemm(32, 64, 64), align_block=32),
    ]
    pipes = [MoEPipeline(shape, c, inp.w1, inp.w2, naive=False) for c in configs]
    fns = [lambda p=p: p(inp.x, inp.topk_weights, inp.topk_ids) for p in pipes]
    eager_out = pipes[0](inp.x, inp.topk_weights, inp.topk_ids).clone()
    for method in ("graph", "eager"):
        samples = time_interleaved(fns, reps=5, method=method, calls_per_sample=4)
        assert len(samples) == 2 and all(len(s) == 5 for s in samples)
        assert all(0 < v < 1e5 for s in samples for v in s)
    pipes[0].out.fill_(float("nan"))
    from mxdb.kernels.timing import capture

    capture(fns[0], 2).replay()
    torch.cuda.synchronize()
    assert torch.equal(pipes[0].out, eager_out)


@pytest.mark.parametrize("n", [1, 4096 * 16, 4096 * 16 * 3 + 77])
@pytest.mark.parametrize("variant", [(4096, 16, 8), (16384, 4, 16), (2048, 32, 4)])
def test_the_streaming_read_probe_sums_every_element_once(torch, n, variant):
    from mxdb.kernels.stream import stream_sum

    x = torch.randn(n, dtype=torch.float32, device="cuda").to(torch.bfloat16)
    partial = stream_sum(x, variant)
    assert partial.numel() == -(-n // (variant[0] * variant[1]))
    want = x.float().sum().item()
    assert abs(partial.sum().item() - want) <= 1e-3 * max(1.0, abs(want)) + 1e-2


def test_read_and_copy_probes_give_rates(torch):
    from mxdb.kernels.timing import (
        copy_bandwidth_samples,
        read_bandwidth_samples,
        torch_sum_read_samples,
    )

    for samples in (
        read_bandwidth_samples(3),
        torch_sum_read_samples(3),
        copy_bandwidth_samples(3),
    ):
        # an H200 moves a few TB/s; any GPU here more than 50 GB/s and less than 50 TB/s
        assert len(samples) == 3 and all(5e10 < v < 5e13 for v in samples), samples


def test_backend_compile_results_and_check(torch):
    import numpy as np
    from mxdb.kernels.backend import GpuBackend

    shape = MoEShape(*SMALL, tokens=16, dtype="bf16")
    backend = GpuBackend(compile_workers=2)
    try:
        base = backend.baseline_config(shape)
        # far beyond 227 KiB of shared memory: out of resources, or Triton fails to compile it
        huge = KernelConfig.uniform(_gemm(256, 256, 256, s=5))
        res = backend.compile(shape, [base, huge])
        assert res[0].status == "ok", res[0]
        assert res[1].status in ("oor", "compile_error") and res[1].error, res[1]
        ids = np.random.default_rng(0).permuted(np.tile(np.arange(16), (16, 1)), axis=1)[:, :4]
        timings = backend.time(shape, ids, [base, huge, base], reps=3, seed=1)
        assert [t.status for t in timings] == ["ok", res[1].status, "ok"], timings
        assert all(len(t.samples_us) == 3 for t in (timings[0], timings[2]))
        corr = backend.check(shape, ids, base, seed=1)
        assert corr.passed, corr
        fp = backend.fingerprint()
        assert fp.arch and fp.sm_count and fp.flag_gems and fp.kernel_source_hash
    finally:
        backend.close()


def test_live_fingerprint_components(torch):
    import mxdb.kernels

    c = mxdb.kernels.live_fingerprint_components()
    assert c["sm_count"] > 0 and c["warp_size"] in (32, 64)
    assert c["smem_per_block"] >= 48 * 1024
    assert c["torch"] == torch.__version__


def test_moe_layer_per_m_configs_eager_graphed_and_captured(torch):
    from mxdb.kernels.layer import MoELayer
    from mxdb.kernels.reference import compare, make_inputs, moe_reference

    asked: list[int] = []
    split = KernelConfig(gemm1=_gemm(16, 64, 64), gemm2=_gemm(32, 64, 128), align_block=32)

    def config_for(m):
        asked.append(m)
        return split if m >= 8 else None  # None: FlagGems' own choice

    big = make_inputs(MoEShape(*SMALL, tokens=40, dtype="bf16"), 21)
    eager = MoELayer(big.w1, big.w2, SMALL[3], config_for)
    graphed = MoELayer(big.w1, big.w2, SMALL[3], config_for, graphs=True)
    for m in (1, 5, 40, 5, 40):
        x, tw, ids = big.x[:m].contiguous(), big.topk_weights[:m], big.topk_ids[:m]
        tw, ids = tw.contiguous(), ids.contiguous()
        ref = moe_reference(x, big.w1, big.w2, tw, ids)
        a = eager(x, tw, ids).clone()
        assert compare(a, ref, "bf16").passed
        for _ in range(3):  # warm-up call, capture, replay
            b = graphed(x, tw, ids).clone()
            assert torch.equal(a, b)
    assert sorted(set(asked)) == [1, 5, 40] and len(asked) == 6  # once per M per layer
    assert eager.pipelines[40].config == split and eager.launches(40)  # recorded plan
    # the eager layer can be captured in the caller's own graph
    x, tw, ids = big.x[:5].contiguous(), big.topk_weights[:5].contiguous(), big.topk_ids[:5]
    ids = ids.contiguous()
    expected = eager(x, tw, ids).clone()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(g, stream=s):
        out = eager(x, tw, ids)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
