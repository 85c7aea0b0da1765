"""Fused decode ops in Triton: add+RMSNorm, RMSNorm, RoPE, masked softmax, SwiGLU.

One launch each, float32 arithmetic inside, fp16/bf16 (or fp32) in and out.  Rounding follows
the unfused Hugging Face chains where it changes results that later steps depend on: the new
residual of ``add_rms_norm`` is rounded to the model dtype before it is normalized (exactly as
``residual + x`` in the model dtype, then RMSNorm), and the normalized row is rounded to the
model dtype before the weight multiplies it, as ``weight * h.to(input_dtype)`` does.  RoPE,
softmax and SwiGLU round once, at the end (more accurate than the chains, within an ulp of them).

Every kernel loops over rows with a grid-stride loop, so any row count works with a grid of at
most ``MAX_PROGRAMS`` programs (below every grid-dimension limit).  Row widths up to
``MAX_WIDTH`` elements are handled in one block per row (decode rows: hidden sizes, head dims,
attention spans).

The PyTorch references are in :mod:`mxdb.kernels.decode_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Programs per launch at most; rows beyond are looped over.
MAX_PROGRAMS = 65535
#: Widest row (elements) one program handles in one block.
MAX_WIDTH = 65536


def _grid(rows: int) -> tuple[int]:
    return (max(1, min(rows, MAX_PROGRAMS)),)


def _block(n: int) -> int:
    if n > MAX_WIDTH:
        raise ValueError(f"row width {n} exceeds {MAX_WIDTH}; use the torch implementation")
    return max(16, triton.next_power_of_2(n))


def _warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8


# -- RMSNorm and add+RMSNorm ------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    X,
    R,
    W,
    Y,
    RES,
    n_rows,
    N,
    stride_x,
    stride_r,
    stride_y,
    stride_res,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    for row in range(pid, n_rows, nprog):
        row64 = tl.cast(row, tl.int64)
        h = tl.load(X + row64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(R + row64 * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
            # round the sum to the model dtype, as `residual + x` does, and normalize that
            s = (h + r).to(RES.dtype.element_ty)
            tl.store(RES + row64 * stride_res + cols, s, mask=mask)
            h = s.to(tl.float32)
        var = tl.sum(h * h, axis=0) / N
        rstd = 1.0 / tl.sqrt(var + eps)
        normed = (h * rstd).to(X.dtype.element_ty).to(tl.float32)
        tl.store(Y + row64 * stride_y + cols, (normed * w).to(Y.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rmsnorm(x)`` over the last dim; output dtype is ``weight * x``'s."""
    n = x.shape[-1]
    x2 = _rows(x)
    out_dtype = torch.result_type(weight, x)
    y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    rows = x2.shape[0]
    if rows:
        block = _block(n)
        _rms_norm_kernel[_grid(rows)](
            x2, x2, weight.contiguous(), y, y, rows, n, x2.stride(0), 0, y.stride(0), 0,
            float(eps), HAS_RES=False, BLOCK=block, num_warps=_warps(block),
        )  # fmt: skip
    return y.view(*x.shape[:-1], n)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + x`` (model dtype) and ``weight * rmsnorm(h)``: returns ``(normed, h)``."""
    n = x.shape[-1]
    x2 = _rows(x)
    r2 = _rows(residual)
    res_dtype = torch.result_type(residual, x)
    out_dtype = torch.result_type(weight, torch.empty((), dtype=res_dtype))
    y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    h = torch.empty(x2.shape, dtype=res_dtype, device=x.device)
    rows = x2.shape[0]
    if rows:
        block = _block(n)
        _rms_norm_kernel[_grid(rows)](
            x2, r2, weight.contiguous(), y, h, rows, n, x2.stride(0), r2.stride(0), y.stride(0),
            h.stride(0), float(eps), HAS_RES=True, BLOCK=block, num_warps=_warps(block),
        )  # fmt: skip
    shape = (*x.shape[:-1], n)
    return y.view(shape), h.view(shape)


# -- RoPE -------------------------------------------------------------------------------------


@triton.jit
def _rope_kernel(
    Q, K, C, S, QO, KO,
    n_tok, seq, HQ, HK, HALF,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s,
    sqo_b, sqo_h, sqo_s, sko_b, sko_h, sko_s,
    sc_b, sc_s, ss_b, ss_s,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    d = tl.arange(0, BLOCK_D)
    dm = d < HALF
    hq = tl.arange(0, BLOCK_HQ)
    hk = tl.arange(0, BLOCK_HK)
    mq = (hq[:, None] < HQ) & dm[None, :]
    mk = (hk[:, None] < HK) & dm[None, :]
    for t in range(pid, n_tok, nprog):
        b = tl.cast(t // seq, tl.int64)
        s = tl.cast(t % seq, tl.int64)
        # cos/sin stay [B, S, D]: one row per token, broadcast over every head here
        c1 = tl.load(C + b * sc_b + s * sc_s + d, mask=dm, other=0.0).to(tl.float32)
        c2 = tl.load(C + b * sc_b + s * sc_s + HALF + d, mask=dm, other=0.0).to(tl.float32)
        s1 = tl.load(S + b * ss_b + s * ss_s + d, mask=dm, other=0.0).to(tl.float32)
        s2 = tl.load(S + b * ss_b + s * ss_s + HALF + d, mask=dm, other=0.0).to(tl.float32)
        qp = Q + b * sq_b + s * sq_s + hq[:, None] * sq_h + d[None, :]
        q1 = tl.load(qp, mask=mq, other=0.0).to(tl.float32)
        q2 = tl.load(qp + HALF, mask=mq, other=0.0).to(tl.float32)
        qo = QO + b * sqo_b + s * sqo_s + hq[:, None] * sqo_h + d[None, :]
        tl.store(qo, (q1 * c1[None, :] - q2 * s1[None, :]).to(QO.dtype.element_ty), mask=mq)
        tl.store(qo + HALF, (q2 * c2[None, :] + q1 * s2[None, :]).to(QO.dtype.element_ty), mask=mq)
        kp = K + b * sk_b + s * sk_s + hk[:, None] * sk_h + d[None, :]
        k1 = tl.load(kp, mask=mk, other=0.0).to(tl.float32)
        k2 = tl.load(kp + HALF, mask=mk, other=0.0).to(tl.float32)
        ko = KO + b * sko_b + s * sko_s + hk[:, None] * sko_h + d[None, :]
        tl.store(ko, (k1 * c1[None, :] - k2 * s1[None, :]).to(KO.dtype.element_ty), mask=mk)
        tl.store(ko + HALF, (k2 * c2[None, :] + k1 * s2[None, :]).to(KO.dtype.element_ty), mask=mk)


def _bsd(t: torch.Tensor, batch: int) -> tuple[int, int]:
    """Batch and sequence strides of cos/sin ``[B or 1, S, D]`` (0 for a broadcast batch)."""
    if t.dim() == 2:
        return 0, t.stride(0)
    return (t.stride(0) if t.shape[0] == batch and batch > 1 else 0), t.stride(1)


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of ``q`` ``[B, Hq, S, D]`` and ``k`` ``[B, Hk, S, D]`` (any strides with a
    unit last stride); ``cos``/``sin`` ``[B, S, D]`` or ``[S, D]`` in HF's duplicated-halves form."""
    bsz, hq, seq, dim = q.shape
    hk = k.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    qo = torch.empty_like(q)
    ko = torch.empty_like(k)
    n_tok = bsz * seq
    if n_tok:
        half = dim // 2
        cb, cs = _bsd(cos, bsz)
        sb, ss = _bsd(sin, bsz)
        bhq = triton.next_power_of_2(hq)
        bhk = triton.next_power_of_2(hk)
        bd = max(16, triton.next_power_of_2(half))
        _rope_kernel[_grid(n_tok)](
            q, k, cos, sin, qo, ko, n_tok, seq, hq, hk, half,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
            cb, cs, sb, ss, BLOCK_HQ=bhq, BLOCK_HK=bhk, BLOCK_D=bd,
            num_warps=_warps(bhq * bd),
        )  # fmt: skip
    return qo, ko


# -- masked softmax ---------------------------------------------------------------------------


@triton.jit
def _masked_softmax_kernel(
    X, M, Y, n_rows, N, H, SQ, stride_x, stride_y, sm_b, sm_h, sm_q, scale,
    HAS_MASK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    cm = cols < N
    for row in range(pid, n_rows, nprog):
        r64 = tl.cast(row, tl.int64)
        x = tl.load(X + r64 * stride_x + cols, mask=cm, other=0.0).to(tl.float32) * scale
        if HAS_MASK:
            b = r64 // (H * SQ)
            h = (r64 // SQ) % H
            q = r64 % SQ
            x += tl.load(M + b * sm_b + h * sm_h + q * sm_q + cols, mask=cm, other=0.0).to(
                tl.float32
            )
        x = tl.where(cm, x, float("-inf"))
        e = tl.exp(x - tl.max(x, axis=0))
        e = tl.where(cm, e, 0.0)
        tl.store(Y + r64 * stride_y + cols, (e / tl.sum(e, axis=0)).to(Y.dtype.element_ty), mask=cm)


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """``softmax(scores * scale + mask)`` in float32 over the last dim, cast to ``scores.dtype``.

    ``scores`` is ``[B, H, Sq, Sk]``; ``mask`` broadcasts to it (``[B or 1, H or 1, Sq, Sk]``).
    """
    bsz, heads, sq, sk = scores.shape
    x2 = _rows(scores)
    y = torch.empty(x2.shape, dtype=scores.dtype, device=scores.device)
    rows = x2.shape[0]
    if rows:
        block = _block(sk)
        if mask is not None:
            m = mask[..., :sk]
            if m.stride(-1) != 1:
                m = m.contiguous()
            m = m.expand(bsz, heads, sq, sk)
            mb, mh, mq = m.stride(0), m.stride(1), m.stride(2)
        else:
            m, mb, mh, mq = x2, 0, 0, 0
        _masked_softmax_kernel[_grid(rows)](
            x2, m, y, rows, sk, heads, sq, x2.stride(0), y.stride(0), mb, mh, mq, float(scale),
            HAS_MASK=mask is not None, BLOCK=block, num_warps=_warps(block),
        )  # fmt: skip
    return y.view(bsz, heads, sq, sk)


# -- SwiGLU -----------------------------------------------------------------------------------


@triton.jit
def _swiglu_kernel(G, U, Y, n_rows, N, stride_g, stride_u, stride_y, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_col_blocks = tl.cdiv(N, BLOCK)
    cols0 = tl.arange(0, BLOCK)
    for tile in range(pid, n_rows * n_col_blocks, nprog):
        row = tl.cast(tile // n_col_blocks, tl.int64)
        cols = (tile % n_col_blocks) * BLOCK + cols0
        cm = cols < N
        g = tl.load(G + row * stride_g + cols, mask=cm, other=0.0).to(tl.float32)
        u = tl.load(U + row * stride_u + cols, mask=cm, other=0.0).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
        tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=cm)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``; ``gate`` and ``up`` may be halves (views) of one projection."""
    n = gate.shape[-1]
    g2 = _rows(gate)
    u2 = _rows(up)
    y = torch.empty(g2.shape, dtype=torch.result_type(gate, up), device=gate.device)
    rows = g2.shape[0]
    if rows:
        block = min(1024, max(16, triton.next_power_of_2(n)))
        tiles = rows * triton.cdiv(n, block)
        _swiglu_kernel[_grid(tiles)](
            g2, u2, y, rows, n, g2.stride(0), u2.stride(0), y.stride(0), BLOCK=block,
            num_warps=_warps(block),
        )  # fmt: skip
    return y.view(*gate.shape[:-1], n)


OPS = {
    "rms_norm": rms_norm,
    "add_rms_norm": add_rms_norm,
    "rope": rope,
    "masked_softmax": masked_softmax,
    "swiglu": swiglu,
}
