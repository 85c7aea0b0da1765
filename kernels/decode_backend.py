"""The decode tuner's GPU backend, and FlagGems' decode ops behind mxdb's op signatures.

``DecodeGpuBackend`` implements :class:`mxdb.tune.decode.DecodeBackend`: inputs from a seed,
every implementation timed on the same inputs with CUDA-graph replays interleaved
(:func:`mxdb.kernels.timing.time_interleaved`), outputs compared with the float32 references of
:mod:`mxdb.kernels.decode_ref`.

``flaggems_ops()`` adapts FlagGems 5.0.2 (``flag_gems.ops.rms_norm``,
``flag_gems.fused.fused_add_rms_norm`` (in place: it is given copies),
``flag_gems.fused.apply_rotary_pos_emb``, ``flag_gems.ops.softmax`` after a torch scale + mask,
``flag_gems.fused.silu_and_mul``) to the signatures of :mod:`mxdb.integrations.impls`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from mxdb.kernels import decode_ref

from mxdb.models import Fingerprint
from mxdb.shapes import canonical_dtype
from mxdb.tune.backend import Correctness, Timing

_TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def flaggems_ops() -> dict[str, Callable[..., Any]]:
    import flag_gems
    from flag_gems import fused as fg_fused
    from flag_gems import ops as fg_ops

    def rms_norm(x: Any, w: Any, eps: float) -> Any:
        if w.dtype != x.dtype:  # FlagGems writes x's dtype; keep the model's promotion
            return decode_ref.rms_norm(x, w, eps)
        return fg_ops.rms_norm(x, [x.shape[-1]], w, eps)

    def add_rms_norm(x: Any, r: Any, w: Any, eps: float) -> Any:
        # FlagGems normalizes the float32 sum (the residual it writes is rounded separately)
        y, h = fg_fused.fused_add_rms_norm(x.clone(), r.clone(), [x.shape[-1]], w, eps)
        return y, h

    def rope(q: Any, k: Any, cos: Any, sin: Any) -> Any:
        bsz, _, seq, d = q.shape
        half = d // 2
        c = cos.expand(bsz, seq, d)[..., :half].reshape(bsz * seq, half).contiguous()
        s = sin.expand(bsz, seq, d)[..., :half].reshape(bsz * seq, half).contiguous()
        pos = torch.arange(bsz * seq, device=q.device).view(bsz, seq)
        qt = q.transpose(1, 2)
        kt = k.transpose(1, 2)
        qo, ko = fg_fused.apply_rotary_pos_emb(qt, kt, c, s, pos, rotary_interleaved=False)
        return qo.transpose(1, 2), ko.transpose(1, 2)

    def masked_softmax(scores: Any, mask: Any, scale: float) -> Any:
        x = scores.float() * scale
        if mask is not None:
            x = x + mask
        return fg_ops.softmax(x, -1, False).to(scores.dtype)

    def swiglu(gate: Any, up: Any) -> Any:
        return fg_fused.silu_and_mul(gate, up)

    del flag_gems
    return {
        "rms_norm": rms_norm,
        "add_rms_norm": add_rms_norm,
        "rope": rope,
        "masked_softmax": masked_softmax,
        "swiglu": swiglu,
    }


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
        from mxdb.integrations.impls import available

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
        from mxdb.evidence.thresholds import THRESHOLDS, passes

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
