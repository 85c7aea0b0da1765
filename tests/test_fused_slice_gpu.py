"""GPU tests of the ``fused_slice`` implementation: layer, sparse mode, recorded layer, graphs.

Every output is poisoned with NaN before the run and compared with the float32 reference.  The
kernel's atomic float32 sums add in a varying order, so repeated calls are compared with the
reference each, not with each other bit for bit; the accumulator must be clear after each call.
"""

from __future__ import annotations

import pytest

from mxdb.configs import KernelConfig
from mxdb.shapes import MoEShape
from tests.test_kernels_gpu import _run_case

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def torch(cuda_torch):
    return cuda_torch


def _slice(bi: int = 64, bk: int = 64, bh: int = 128, bm: int = 16, align: int | None = None):
    return KernelConfig.fused_slice(
        block_m=bm, block_i=bi, block_k=bk, block_h=bh, align_block=align
    )


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("tokens", [1, 3, 37, 200])
def test_fused_slice_layer_matches_reference(torch, dtype, tokens):
    # I = 720: the last slice of 64 or 128 columns is partial
    shape = MoEShape(16, 1024, 720, 4, tokens=tokens, dtype=dtype)
    for config in (_slice(), _slice(128, 128, 256, 16, 32), _slice(64, 256, 64, 32)):
        p, rep, out, _ = _run_case(torch, shape, config, seed=tokens)
        assert bool(torch.isfinite(out).all()), "some output rows were never written"
        assert rep.passed, (config.short(), rep)
        assert p.slice is not None and not p.deterministic
        assert p.cache1.numel() == p.cache2.numel() == p.cache3.numel() == 0
        assert float(p.acc.abs().max()) == 0.0  # cleared for the next call
        assert (p.one_pass is not None) == (not p.naive)


def test_fused_slice_sparse_mode_int64_ids_and_hot_expert(torch):
    shape = MoEShape(128, 1024, 768, 8, tokens=2, dtype="bf16")  # 16 slots x 4 <= 128: naive
    gen = torch.Generator(device="cuda").manual_seed(9)
    ids = torch.rand((2, 128), generator=gen, device="cuda").topk(8).indices  # int64
    p, rep, _, _ = _run_case(torch, shape, _slice(), ids, seed=9)
    assert p.naive and rep.passed, rep
    # every token on expert 3 (tiles of 16 slots of one expert), others empty
    shape = MoEShape(16, 1024, 768, 4, tokens=45, dtype="bf16")
    others = torch.rand((45, 16), generator=gen, device="cuda")
    others[:, 3] = -1.0
    ids = torch.cat(
        [torch.full((45, 1), 3, device="cuda"), others[:, :8].topk(3, dim=-1).indices], dim=1
    ).to(torch.int32)
    for naive in (False, True):
        _, rep, _, _ = _run_case(torch, shape, _slice(), ids, seed=5, naive=naive)
        assert rep.passed, (naive, rep)


def test_fused_slice_layer_records_and_replays_in_a_graph(torch):
    from mxdb.kernels.layer import MoELayer
    from mxdb.kernels.reference import compare, make_inputs, moe_reference

    shape = MoEShape(16, 1024, 768, 4, tokens=24, dtype="bf16")
    inp = make_inputs(shape, 21)
    config = _slice()
    layer = MoELayer(inp.w1, inp.w2, shape.topk, lambda _m: config)
    ref = moe_reference(inp.x, inp.w1, inp.w2, inp.topk_weights, inp.topk_ids)
    outs = [layer(inp.x, inp.topk_weights, inp.topk_ids).clone() for _ in range(3)]
    assert not layer.record_errors, layer.record_errors
    for out in outs:
        assert compare(out, ref, shape.dtype).passed
    graph = torch.cuda.CUDAGraph()
    static = layer(inp.x, inp.topk_weights, inp.topk_ids)
    with torch.cuda.graph(graph):
        static = layer(inp.x, inp.topk_weights, inp.topk_ids)
    for _ in range(3):  # each replay starts from a clear accumulator
        static.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert compare(static, ref, shape.dtype).passed


def test_fused_slice_compiles_in_workers_and_backend_checks_it(torch):
    import numpy as np
    from mxdb.kernels.backend import GpuBackend
    from mxdb.kernels.compile import CompilePool, combine, specs_for

    shape = MoEShape(16, 1024, 768, 4, tokens=37, dtype="bf16")
    ok = _slice()
    # gate and up tiles of 256 x 256 at 4 stages exceed the shared memory of any GPU
    too_big = KernelConfig.fused_slice(
        block_m=64, block_i=256, block_k=256, block_h=256, num_stages=4
    )
    assert specs_for(shape, ok)[0] == specs_for(shape, ok)[1]
    pool = CompilePool(workers=2)
    try:
        results = pool.run([*specs_for(shape, ok), *specs_for(shape, too_big)])
    finally:
        pool.close()
    assert combine(results[:2])[0] == "ok", results[:2]
    assert combine(results[2:])[0] == "oor", results[2:]
    be = GpuBackend(compile_workers=2)
    try:
        ids = np.argsort(np.random.default_rng(0).random((37, 16)), axis=1)[:, :4]
        assert be.check(shape, ids, ok, seed=1).passed
        (t,) = be.time(shape, ids, [ok], reps=3, seed=1)
        assert t.status == "ok" and len(t.samples_us) == 3
    finally:
        be.close()
