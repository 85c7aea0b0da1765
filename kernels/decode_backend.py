"""The decode tuner's GPU backend.

``DecodeGpuBackend`` implements :class:`mxdb.tune.decode.DecodeBackend`: inputs from a seed,
every implementation timed on the same inputs with CUDA-graph replays interleaved
(:func:`mxdb.kernels.timing.time_interleaved`), outputs compared with the float32 references of
:mod:`mxdb.kernels.decode_ref`.

The implementations it measures are :func:`mxdb.kernels.impls.available`'s (FlagGems' behind
mxdb's op signatures: :mod:`mxdb.kernels.decode_flaggems`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from mxdb.kernels import decode_ref

from mxdb.models import Fingerprint
from mxdb.results import Correctness, Timing
from mxdb.shapes import canonical_dtype

_TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def make_inputs(case: Any, seed: int, device: str = "cuda") -> tuple[Any, ...]:
    """The op's inputs for ``case`` (an ``mxdb.tune.decode.DecodeCase``), from ``seed``."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    dt = _TORCH_DTYPES[canonical_dtype(case.dtype)]
    m = case.tokens
    dims = case.dims

    def rnd(*shape: int, scale: float = 1.0) -> Any:
        return (torch.randn(*shape, generator=g) * scale).to(dt).to(device)

    if case.op == "rms_norm":
        n = dims["n"]
        return rnd(m, n), (1 + rnd(n, scale=0.1)), 1e-6
    if case.op == "add_rms_norm":
        n = dims["n"]
        return rnd(m, n), rnd(m, n), (1 + rnd(n, scale=0.1)), 1e-6
    if case.op == "rope":
        hq, hk, d = dims["hq"], dims["hk"], dims["d"]
        q = rnd(1, m, hq, d).transpose(1, 2)
        k = rnd(1, m, hk, d).transpose(1, 2)
        f = torch.rand(1, m, d // 2, generator=g) * 100
        cos = torch.cat([f.cos(), f.cos()], -1).to(dt).to(device)
        sin = torch.cat([f.sin(), f.sin()], -1).to(dt).to(device)
        return q, k, cos, sin
    if case.op == "masked_softmax":
        h, kk = dims["h"], dims["k"]
        scores = rnd(1, h, m, kk, scale=4.0)
        mask = torch.zeros(1, 1, m, kk, dtype=dt, device=device)
        mask[..., kk - kk // 4 :] = torch.finfo(dt).min
        return scores, mask, 0.125
    if case.op == "swiglu":
        n = dims["n"]
        gu = rnd(m, 2 * n)
        return gu[:, :n], gu[:, n:]
    raise ValueError(f"unknown decode op {case.op!r}")


def _errors(out: Any, ref: Any) -> tuple[float, float]:
    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    max_abs = 0.0
    max_ref = 0.0
    for o, r in zip(outs, refs, strict=True):
        max_abs = max(max_abs, (o.float() - r.float()).abs().max().item())
        max_ref = max(max_ref, r.float().abs().max().item())
    return max_abs, max_abs / max(max_ref, 1e-30)


_FP32_REFS = {
    "rms_norm": decode_ref.rms_norm_fp32,
    "add_rms_norm": decode_ref.add_rms_norm_fp32,
    "rope": decode_ref.rope_fp32,
    "masked_softmax": decode_ref.masked_softmax_fp32,
    "swiglu": decode_ref.swiglu_fp32,
}


class DecodeGpuBackend:
    """Measures the decode ops' implementations on one CUDA device."""

    name = "gpu-decode"

    def __init__(self, device_index: int = 0, *, method: str = "graph") -> None:
        from mxdb.kernels.impls import available

        self.device = f"cuda:{device_index}"
        self.device_index = device_index
        self.method = method
        torch.cuda.set_device(device_index)
        self._impls = available()

    def fingerprint(self) -> Fingerprint:
        from mxdb.kernels.live import live_fingerprint_components

        from mxdb.fingerprint import collect

        return collect(live_fingerprint_components(self.device_index))

    def impls(self, op: str) -> list[str]:
        return [name for name, ops in self._impls.items() if op in ops]

    def time(self, case: Any, impls: Sequence[str], *, reps: int, seed: int) -> list[Timing]:
        from mxdb.kernels.timing import time_interleaved

        args = make_inputs(case, seed, self.device)
        fns = []
        for name in impls:
            fn = self._impls[name][case.op]
            fns.append(lambda fn=fn: fn(*args))
        try:
            samples = time_interleaved(fns, reps=reps, method=self.method)
        except Exception as exc:  # a failure is a result: every candidate of the call failed
            return [Timing("compile_error", (), f"{type(exc).__name__}: {exc}") for _ in impls]
        return [Timing("ok", tuple(s), None) for s in samples]

    def check(self, case: Any, impl: str, *, seed: int) -> Correctness:
        from mxdb.verdict import THRESHOLDS, passes

        args = make_inputs(case, seed + 1, self.device)
        t = THRESHOLDS[canonical_dtype(case.dtype)]
        try:
            out = self._impls[impl][case.op](*args)
            ref = _FP32_REFS[case.op](*args)
            torch.cuda.synchronize()
            max_abs, rel = _errors(out, ref)
        except Exception:
            max_abs, rel = float("inf"), float("inf")
        ok = passes(canonical_dtype(case.dtype), max_abs, rel)
        return Correctness(max_abs, rel, t.max_abs, t.max_rel, ok)
