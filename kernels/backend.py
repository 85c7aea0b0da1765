"""``GpuBackend``: the tuner's measuring device (``mxdb.tune.backend.Backend``) on a live GPU.

* ``baseline_config``: FlagGems 5.0.2's own choice for the call (``try_get_optimal_moe_config``,
  exactly as ``fused_experts_impl`` calls it), asked once per shape.
* ``compile``: both GEMMs of every config compiled in parallel by worker processes
  (:mod:`mxdb.kernels.compile`), filling Triton's on-disk cache before any timing.
* ``time``: one :class:`MoEPipeline` per candidate on shared inputs; every candidate's output is
  first checked against the float32 reference (a wrong one is a ``wrong`` result, not timed);
  then interleaved CUDA-graph replays (or eager calls) of the whole layer.
* ``check``: the whole layer, run twice on a poisoned output, against the float32 reference.

Failures are results: ``oor``, ``compile_error``, ``timeout``, ``wrong``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from mxdb.kernels.compile import CompilePool, combine, specs_for
from mxdb.kernels.live import live_fingerprint_components, live_profile
from mxdb.kernels.pipeline import TORCH_DTYPES, MoEPipeline
from mxdb.kernels.reference import compare, make_activations, make_weights, moe_reference
from mxdb.kernels.timing import time_interleaved

from mxdb.configs import IMPLS, GemmConfig, KernelConfig
from mxdb.models import Fingerprint
from mxdb.results import CompileResult, Correctness, Timing
from mxdb.shapes import MoEShape


def flaggems_config(shape: MoEShape) -> dict[str, int]:
    """What FlagGems 5.0.2's ``fused_experts_impl`` picks for this call (its own function)."""
    from flag_gems.fused.fused_moe import _get_config_dtype_str, try_get_optimal_moe_config

    e, h, i, k = shape.experts, shape.hidden, shape.intermediate, shape.topk
    chunk = 16 * 1024  # fused_experts_impl's CHUNK_SIZE
    return dict(
        try_get_optimal_moe_config(
            (e, 2 * i, h),
            (e, h, i),
            k,
            _get_config_dtype_str(dtype=TORCH_DTYPES[shape.dtype]),
            min(shape.tokens, chunk),
            E=e,
        )
    )


def _classify(exc: BaseException) -> tuple[str, str]:
    from triton.runtime.errors import OutOfResources

    if isinstance(exc, OutOfResources):
        return "oor", str(exc)
    return "compile_error", f"{type(exc).__name__}: {exc}"[:2000]


class GpuBackend:
    """Measures fused-MoE configs on one CUDA device."""

    name = "flaggems-triton-gpu"
    #: layer implementations ``MoEPipeline`` runs
    impls: tuple[str, ...] = IMPLS

    def __init__(
        self,
        device_index: int = 0,
        *,
        calls_per_sample: int = 8,
        warmup: int = 3,
        compile_workers: int | None = None,
        compile_timeout_s: float = 180.0,
    ) -> None:
        self.device_index = device_index
        self.device = torch.device("cuda", device_index)
        torch.cuda.set_device(self.device)
        self.calls_per_sample = calls_per_sample
        self.warmup = warmup
        self.compile_timeout_s = compile_timeout_s
        self._pool = CompilePool(device_index, compile_workers)
        self._baselines: dict[MoEShape, KernelConfig] = {}
        self._weights_key: tuple[Any, ...] | None = None
        self._weights: tuple[torch.Tensor, torch.Tensor] | None = None
        self._acts: dict[tuple[Any, ...], tuple[Any, ...]] = {}

    # -- environment ------------------------------------------------------------------------
    def fingerprint(self) -> Fingerprint:
        from mxdb.version import __version__

        return Fingerprint(**live_fingerprint_components(self.device_index), mxdb=__version__)

    def profile(self) -> Any:
        return live_profile(self.device_index)

    def baseline_config(self, shape: MoEShape) -> KernelConfig:
        cfg = self._baselines.get(shape)
        if cfg is None:
            raw = flaggems_config(shape)
            gemm = GemmConfig.from_triton({k: v for k, v in raw.items() if k != "SWAP_AB"})
            cfg = KernelConfig.uniform(gemm)
            self._baselines[shape] = cfg
        return cfg

    # -- compilation ------------------------------------------------------------------------
    def compile(self, shape: MoEShape, configs: Sequence[KernelConfig]) -> list[CompileResult]:
        pairs = [specs_for(shape, c) for c in configs]
        flat = [s for p in pairs for s in p]
        results = self._pool.run(flat, timeout_s=self.compile_timeout_s)
        out = []
        for j, c in enumerate(configs):
            status, error, seconds = combine(results[2 * j : 2 * j + 2])
            out.append(CompileResult(c.hash, status, error, seconds))  # type: ignore[arg-type]
        return out

    def compile_raw(self, specs: Sequence[Any]) -> list[dict[str, Any]]:
        """Per-GEMM compile results with resource usage (shared, n_regs, n_spills)."""
        return self._pool.run(specs, timeout_s=self.compile_timeout_s)

    def close(self) -> None:
        self._pool.close()

    # -- inputs -----------------------------------------------------------------------------
    def _inputs(self, shape: MoEShape, topk_ids: np.ndarray, seed: int) -> tuple[Any, ...]:
        wkey = (shape.family, shape.dtype, seed)
        if self._weights_key != wkey:
            self._weights = None
            self._acts.clear()
            torch.cuda.empty_cache()
            self._weights = make_weights(shape, seed, self.device)
            self._weights_key = wkey
        ids_np = np.ascontiguousarray(np.asarray(topk_ids, dtype=np.int32))
        akey = (shape, seed, hashlib.sha256(ids_np.tobytes()).hexdigest())
        acts = self._acts.get(akey)
        if acts is None:
            if len(self._acts) > 16:
                self._acts.clear()
            ids = torch.from_numpy(ids_np).to(self.device)
            x, tw, ids = make_activations(shape, seed, ids, self.device)
            assert self._weights is not None
            ref = moe_reference(x, *self._weights, tw, ids)
            acts = (x, tw, ids, ref)
            self._acts[akey] = acts
        assert self._weights is not None
        return (*self._weights, *acts)

    # -- timing -----------------------------------------------------------------------------
    def time(
        self,
        shape: MoEShape,
        topk_ids: np.ndarray,
        configs: Sequence[KernelConfig],
        *,
        reps: int,
        seed: int,
        method: str = "graph",
        order_seed: int | None = None,
    ) -> list[Timing]:
        w1, w2, x, tw, ids, ref = self._inputs(shape, topk_ids, seed)
        results: list[Timing | None] = [None] * len(configs)
        live: list[int] = []
        fns = []
        for j, c in enumerate(configs):
            try:
                p = MoEPipeline(shape, c, w1, w2)
                out = p(x, tw, ids)
                torch.cuda.synchronize()
            except Exception as exc:
                status, err = _classify(exc)
                results[j] = Timing(status, (), err)  # type: ignore[arg-type]
                continue
            rep = compare(out, ref, shape.dtype)
            if not rep.passed:
                results[j] = Timing(
                    "wrong",
                    (),
                    f"max abs err {rep.max_abs_err:.3g} (limit {rep.threshold_abs:.3g}), "
                    f"rel err {rep.rel_err:.3g} (limit {rep.threshold_rel:.3g})",
                )
                continue
            live.append(j)
            fns.append(lambda p=p: p(x, tw, ids))
        if fns:
            samples = time_interleaved(
                fns,
                reps=reps,
                method=method,
                calls_per_sample=self.calls_per_sample,
                warmup=self.warmup,
                order_seed=order_seed,
            )
            for j, s in zip(live, samples, strict=True):
                results[j] = Timing("ok", tuple(s), None)
        return [r for r in results if r is not None]

    # -- correctness ------------------------------------------------------------------------
    def check(
        self, shape: MoEShape, topk_ids: np.ndarray, config: KernelConfig, *, seed: int
    ) -> Correctness:
        w1, w2, x, tw, ids, ref = self._inputs(shape, topk_ids, seed)
        p = MoEPipeline(shape, config, w1, w2)
        out1 = torch.full_like(p.out, float("nan"))
        out2 = torch.full_like(p.out, float("nan"))
        p(x, tw, ids, out=out1)
        p(x, tw, ids, out=out2)
        torch.cuda.synchronize()
        rep = compare(out1, ref, shape.dtype)
        if p.deterministic:
            same = bool(torch.equal(out1, out2))
        else:
            # atomic float32 sums (fused_slice): each call must pass on its own
            same = compare(out2, ref, shape.dtype).passed
        return Correctness(
            rep.max_abs_err, rep.rel_err, rep.threshold_abs, rep.threshold_rel, rep.passed and same
        )
