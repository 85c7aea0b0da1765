"""Parallel compilation of GEMM configs on the host's CPU cores, apart from timing.

Worker processes (spawned, one CUDA context each) call ``fused_moe_kernel.warmup`` with the very
arguments :class:`mxdb.kernels.pipeline.MoEPipeline` launches with (torch dtypes in place of
tensors), which compiles without launching and fills Triton's on-disk cache; they then load the
binary (``_init_handles``), which is where Triton reports a kernel that needs more shared memory
or threads than the device has.  The timing process later finds the binaries in the cache.

Failures are results: ``oor`` (Triton's ``OutOfResources``, with the resource, the required
amount and the limit), ``compile_error`` (anything else), ``timeout``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from mxdb.resources import VLLM_GRID

_WORKER_DEVICE = 0
_IN_WORKER = False


@dataclass(frozen=True)
class GemmSpec:
    """One GEMM compilation, as plain picklable data."""

    which: str
    experts: int
    hidden: int
    intermediate: int
    topk: int
    tokens: int
    dtype: str
    gemm: tuple[int, int, int, int, int, int]  # block_m, block_n, block_k, group_m, warps, stages
    align_block: int
    naive: bool
    #: the layer implementation; ``fused_act``'s GEMM1 is mxdb's kernel, its GEMM2 FlagGems';
    #: ``fused_slice`` is one kernel (both specs name it, with gemm2's ``block_n`` as block_h)
    impl: str = "flaggems"
    block_h: int = 0

    def key(self) -> tuple[Any, ...]:
        return tuple(asdict(self).values())


def specs_for(shape: Any, config: Any, naive: bool | None = None) -> tuple[GemmSpec, GemmSpec]:
    """The two GEMM compilations of ``config`` at ``shape`` (no GPU needed)."""
    from mxdb.kernels.pipeline import uses_naive_assignment

    if naive is None:
        naive = uses_naive_assignment(shape.tokens, shape.topk, shape.experts)
    out = []
    if config.impl == "fused_slice":
        g = config.gemm1
        one = GemmSpec(
            which="gemm1", experts=shape.experts, hidden=shape.hidden,
            intermediate=shape.intermediate, topk=shape.topk, tokens=shape.tokens,
            dtype=shape.dtype,
            gemm=(g.block_m, g.block_n, g.block_k, g.group_m, g.num_warps, g.num_stages),
            align_block=config.align_block, naive=naive, impl="fused_slice",
            block_h=config.gemm2.block_n,
        )  # fmt: skip
        return one, one  # the pool compiles a repeated spec once
    for which, g in (("gemm1", config.gemm1), ("gemm2", config.gemm2)):
        out.append(
            GemmSpec(
                which=which,
                experts=shape.experts,
                hidden=shape.hidden,
                intermediate=shape.intermediate,
                topk=shape.topk,
                tokens=shape.tokens,
                dtype=shape.dtype,
                gemm=(g.block_m, g.block_n, g.block_k, g.group_m, g.num_warps, g.num_stages),
                align_block=config.align_block,
                naive=naive,
                impl=config.impl if which == "gemm1" else "flaggems",
            )
        )
    return out[0], out[1]


def _init_worker(device_index: int) -> None:
    global _WORKER_DEVICE, _IN_WORKER
    _WORKER_DEVICE = device_index
    _IN_WORKER = True
    import torch

    torch.cuda.set_device(device_index)
    import flag_gems.fused.fused_moe  # noqa: F401  (import once, before the first task)


@contextlib.contextmanager
def _captured_stderr() -> Iterator[list[str]]:
    """In a worker, send fd 2 (where MLIR prints its failures) to a file; yield its tail."""
    tail: list[str] = []
    if not _IN_WORKER:
        yield tail
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as f:
        os.dup2(f.fileno(), 2)
        try:
            yield tail
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            lines = [ln for ln in f.read().decode(errors="replace").splitlines() if "error:" in ln]
            tail.extend(lines[-3:])


def compile_spec(spec: GemmSpec) -> dict[str, Any]:
    """Compile and load one GEMM; never raises.  Runs in a worker (or in-process)."""
    t0 = time.perf_counter()
    with _captured_stderr() as diag:
        res = _compile_spec(spec)
    if res["status"] == "compile_error" and diag:
        res["error"] = f"{res['error']} | {' | '.join(diag)}"[:2000]
    res["seconds"] = time.perf_counter() - t0
    return res


def _compile_spec(spec: GemmSpec) -> dict[str, Any]:
    res: dict[str, Any] = {"status": "ok", "error": None}
    try:
        import torch
        from flag_gems.fused.fused_moe import fused_moe_kernel
        from mxdb.kernels.fused_act import gemm1_act_kernel
        from mxdb.kernels.fused_slice import fused_slice_kernel
        from mxdb.kernels.pipeline import TORCH_DTYPES, act_launch, gemm_launches, slice_launch
        from triton.runtime.errors import OutOfResources

        from mxdb.configs import GemmConfig, KernelConfig
        from mxdb.shapes import MoEShape

        shape = MoEShape(
            spec.experts, spec.hidden, spec.intermediate, spec.topk, spec.tokens, spec.dtype
        )
        bm, bn, bk, gm, w, s = spec.gemm
        g = GemmConfig(block_m=bm, block_n=bn, block_k=bk, group_m=gm, num_warps=w, num_stages=s)
        config = KernelConfig(gemm1=g, gemm2=g, align_block=spec.align_block)
        launch = gemm_launches(shape, config, spec.naive)[0 if spec.which == "gemm1" else 1]
        dt = TORCH_DTYPES[spec.dtype]
        i32 = torch.int32
        jit: Any = fused_moe_kernel
        if spec.impl == "fused_slice":
            jit = fused_slice_kernel
            sliced = KernelConfig.fused_slice(
                block_m=bm, block_i=bn, block_k=bk, block_h=spec.block_h, num_warps=w,
                num_stages=s, align_block=spec.align_block,
            )  # fmt: skip
            l1, l2 = gemm_launches(shape, sliced, spec.naive)
            f32 = torch.float32
            args, kwargs = slice_launch(l1, l2, spec.intermediate, spec.hidden).args(
                dt, dt, dt, f32, f32, i32, i32, i32
            )
        elif spec.impl == "fused_act":
            jit = gemm1_act_kernel
            args, kwargs = act_launch(launch, spec.intermediate, spec.hidden).args(
                dt, dt, dt, i32, i32, i32
            )
        else:
            args, kwargs = launch.args(dt, dt, dt, torch.float32, i32, i32, i32)
        try:
            kernel = jit.warmup(*args, grid=(1,), **kwargs)
            if hasattr(kernel, "result"):
                kernel = kernel.result()
            res["shared"] = int(kernel.metadata.shared)
            kernel._init_handles()
            res["n_regs"] = int(kernel.n_regs)
            res["n_spills"] = int(kernel.n_spills)
        except OutOfResources as exc:
            res.update(
                status="oor",
                error=str(exc),
                resource=exc.name,
                required=int(exc.required),
                limit=int(exc.limit),
            )
    except Exception as exc:
        res.update(status="compile_error", error=f"{type(exc).__name__}: {exc}"[:2000])
    return res


class CompilePool:
    """A persistent pool of spawned compile workers, one per host core (less one) by default."""

    def __init__(self, device_index: int = 0, workers: int | None = None) -> None:
        self.device_index = device_index
        env = os.environ.get("MXDB_COMPILE_WORKERS", "")
        default = int(env) if env.isdigit() and int(env) > 0 else max(1, (os.cpu_count() or 2) - 1)
        self.workers = workers or default
        self._pool: Any = None

    def _get(self) -> Any:
        if self._pool is None:
            ctx = mp.get_context("spawn")
            self._pool = ctx.Pool(
                self.workers, initializer=_init_worker, initargs=(self.device_index,)
            )
        return self._pool

    def run(self, specs: Sequence[GemmSpec], timeout_s: float = 180.0) -> list[dict[str, Any]]:
        """Compile ``specs`` (duplicates once); one result dict per spec, in order.

        ``timeout_s`` bounds each compile: the whole batch gets ``timeout_s`` per round of
        ``workers`` compiles; whatever has not finished by then is a ``timeout`` and the pool is
        replaced (a hung worker cannot be interrupted otherwise).
        """
        unique: dict[tuple[Any, ...], GemmSpec] = {}
        for s in specs:
            unique.setdefault(s.key(), s)
        pool = self._get()
        pending = {k: pool.apply_async(compile_spec, (s,)) for k, s in unique.items()}
        rounds = -(-len(unique) // self.workers)
        deadline = time.monotonic() + timeout_s * max(1, rounds) + 30.0
        done: dict[tuple[Any, ...], dict[str, Any]] = {}
        timed_out = False
        for k, fut in pending.items():
            try:
                done[k] = fut.get(timeout=max(0.0, deadline - time.monotonic()))
            except mp.TimeoutError:
                timed_out = True
                done[k] = {
                    "status": "timeout",
                    "error": f"not compiled within {timeout_s:.0f} s",
                    "seconds": timeout_s,
                }
            except Exception as exc:  # a worker died
                done[k] = {"status": "compile_error", "error": repr(exc)[:2000], "seconds": 0.0}
        if timed_out:
            self.close(terminate=True)
        return [done[s.key()] for s in specs]

    def close(self, terminate: bool = False) -> None:
        if self._pool is not None:
            if terminate:
                self._pool.terminate()
            else:
                self._pool.close()
            self._pool.join()
            self._pool = None


def combine(results: Sequence[dict[str, Any]]) -> tuple[str, str | None, float]:
    """One status for a config from its GEMMs' results: the worst wins."""
    order = {"ok": 0, "compile_error": 1, "oor": 2, "timeout": 3}
    worst = max(results, key=lambda r: order.get(r["status"], 1))
    errors = [r["error"] for r in results if r.get("error")]
    return worst["status"], "; ".join(errors) or None, sum(r["seconds"] for r in results)


def vllm_grid_tuples() -> list[tuple[int, int, int, int, int]]:
    """The 480 distinct compilations of vLLM's 1,920-config grid: (M, N, K, warps, stages)."""
    grid = VLLM_GRID
    return [
        (bm, bn, bk, w, s)
        for bm in grid["block_m"]
        for bn in grid["block_n"]
        for bk in grid["block_k"]
        for w in grid["num_warps"]
        for s in grid["num_stages"]
    ]
