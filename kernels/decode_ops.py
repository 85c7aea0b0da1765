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

Launch path: the op functions here are those of one :class:`~mxdb.kernels.decode_launch.DecodeOps`
(``DEFAULT``).  The first call at a key goes through Triton's JIT launch while it is recorded;
later calls replay Triton's compiled launcher with the call's pointers and scalars (no Triton
binder, no launch hooks, no temporaries).  Where recording is refused (Triton's interpreter,
unknown Triton internals) Triton's normal launch is kept.  :func:`launch_paths` says which path
is in use; ``MXDB_DECODE_RECORD=0`` turns recording off for the default instance;
:func:`make_ops` builds another instance (``record=False``: the JIT path; ``max_programs``: a
smaller grid, to exercise the grid-stride loops).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl
from mxdb.kernels.decode_launch import DecodeOps

#: Programs per launch at most; rows beyond are looped over.
MAX_PROGRAMS = 65535
#: Widest row (elements) one program handles in one block.
MAX_WIDTH = 65536


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


# -- the ops: recorded launches over the kernels above -----------------------------------------

KERNELS = {
    "rms_norm": _rms_norm_kernel,
    "rope": _rope_kernel,
    "masked_softmax": _masked_softmax_kernel,
    "swiglu": _swiglu_kernel,
}


def _launcher_cls() -> Any:
    from triton.runtime import driver

    return driver.active.launcher_cls


def _stream_for(device: int) -> Any:
    return functools.partial(torch._C._cuda_getCurrentRawStream, device)


def make_ops(*, record: bool = True, max_programs: int = MAX_PROGRAMS) -> DecodeOps:
    """A fresh set of the ops (own caches): ``record=False`` keeps Triton's JIT launch."""
    return DecodeOps(
        KERNELS, _launcher_cls, _stream_for, record=record, max_programs=max_programs,
        max_width=MAX_WIDTH,
    )  # fmt: skip


DEFAULT = make_ops(record=os.environ.get("MXDB_DECODE_RECORD", "1") != "0")

rms_norm = DEFAULT.rms_norm
add_rms_norm = DEFAULT.add_rms_norm
rope = DEFAULT.rope
masked_softmax = DEFAULT.masked_softmax
swiglu = DEFAULT.swiglu


def launch_paths() -> dict[str, Any]:
    """Which launch path the default ops use (see :meth:`DecodeOps.paths`)."""
    return DEFAULT.paths()


OPS = {
    "rms_norm": rms_norm,
    "add_rms_norm": add_rms_norm,
    "rope": rope,
    "masked_softmax": masked_softmax,
    "swiglu": swiglu,
}
