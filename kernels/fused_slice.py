"""mxdb's small-batch fused-MoE kernel: both GEMMs, the activation and the top-k sum in one launch.

The ``fused_slice`` implementation (:data:`mxdb.configs.IMPLS`) gives each program one tile of
token slots routed to one expert (the alignment's tile, or one slot in the sparse mode) and one
slice of ``block_i`` columns of that expert's intermediate dimension.  The program

1. computes the gate and up tiles ``x[slots] @ w1[e, slice]`` and ``x[slots] @ w1[e, I + slice]``
   over the whole hidden dimension and forms ``silu(gate) * up`` (rounded to the layer dtype, as
   FlagGems rounds the activation's output before GEMM2);
2. multiplies that ``[block_m, block_i]`` tile by ``w2[e, :, slice]`` in chunks of ``block_h``
   output columns, scales each row by its routing weight and adds it into a float32
   ``[M, H]`` accumulator with atomic adds: the slices of one expert and the top-k experts of a
   token all add into the token's row, so GEMM2's output, its re-read and the sum launch go away.

Every weight element is read by exactly one program per tile of slots, and the grid has
``tiles x I / block_i`` programs, so small batches stream the active experts' weights with the
whole device busy: GEMM2 of a decode batch no longer runs one program per ``block_n`` columns of
``H`` (fewer programs than SMs at a handful of touched experts).  A second, elementwise launch
casts the accumulator into the output and clears it for the next call, so a call is two launches
in the sparse mode and three with the one-pass alignment.  The atomic adds make the float32 sum
order vary from call to call (the result, checked against the float32 reference, differs in the
last bits between calls); the work grows with ``tokens x H x I / block_i``, so the tuner offers
this implementation to batches of at most ``mxdb.configs.FUSED_SLICE_MAX_SLOTS`` token slots.

A config maps onto it as: ``gemm1.block_m`` rows per tile, ``gemm1.block_n`` = ``block_i`` (the
slice), ``gemm1.block_k`` the hidden-dimension step of step 1, ``gemm2.block_n`` = ``block_h``,
and ``gemm1``'s warps and stages (``mxdb.configs.KernelConfig`` holds ``gemm2``'s other fields
equal to them).  Plain Triton (``tl.dot``, ``tl.atomic_add``), as mcTriton builds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import triton
import triton.language as tl


@triton.jit
def _fused_slice_kernel(
    x_ptr,
    w1_ptr,
    w2_ptr,
    tw_ptr,
    acc_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    ntpp_ptr,
    hidden,
    inter,
    num_valid,
    top_k: tl.constexpr,
    NAIVE: tl.constexpr,
    compute_type: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0)
    num_slices = tl.cdiv(inter, BLOCK_I)
    # the slices of one tile are neighbours: its activations stay in L2 while they run
    pid_m = pid // num_slices
    pid_i = pid % num_slices
    if pid_m * BLOCK_M >= tl.load(ntpp_ptr):
        return
    rows = tl.arange(0, BLOCK_M)
    if NAIVE:
        # one token slot per tile (the sparse mode): row 0 is slot pid_m, its expert the slot's
        slot = tl.where(rows == 0, pid_m, num_valid)
    else:
        slot = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + rows)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    row_ok = slot < num_valid
    token = (slot // top_k).to(tl.int64)
    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = offs_i < inter
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * hidden + offs_k[None, :]
    g_ptrs = (
        w1_ptr
        + expert * (2 * inter * hidden)
        + offs_i.to(tl.int64)[None, :] * hidden
        + offs_k[:, None]
    )
    u_ptrs = g_ptrs + inter * hidden
    acc_g = tl.zeros((BLOCK_M, BLOCK_I), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_I), dtype=tl.float32)
    for kk in range(0, tl.cdiv(hidden, BLOCK_K)):
        k_ok = offs_k < hidden - kk * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & i_ok[None, :]
        g = tl.load(g_ptrs, mask=w_ok, other=0.0)
        u = tl.load(u_ptrs, mask=w_ok, other=0.0)
        acc_g = tl.dot(a, g, acc=acc_g)
        acc_u = tl.dot(a, u, acc=acc_u)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    act = (acc_g * tl.sigmoid(acc_g) * acc_u).to(compute_type)
    weight = tl.load(tw_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)
    offs_h = tl.arange(0, BLOCK_H)
    b_ptrs = (
        w2_ptr + expert * (hidden * inter) + offs_h.to(tl.int64)[None, :] * inter + offs_i[:, None]
    )
    o_ptrs = acc_ptr + token[:, None] * hidden + offs_h[None, :]
    for hh in range(0, tl.cdiv(hidden, BLOCK_H)):
        h_ok = offs_h < hidden - hh * BLOCK_H
        b = tl.load(b_ptrs, mask=i_ok[:, None] & h_ok[None, :], other=0.0)
        part = tl.dot(act, b) * weight[:, None]
        tl.atomic_add(o_ptrs, part, mask=row_ok[:, None] & h_ok[None, :], sem="relaxed")
        b_ptrs += BLOCK_H * inter
        o_ptrs += BLOCK_H


@triton.jit
def _finish_kernel(acc_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    v = tl.load(acc_ptr + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(acc_ptr + offs, tl.zeros_like(v), mask=ok)


#: The kernels of the ``fused_slice`` implementation (compile workers warm them up).
fused_slice_kernel = _fused_slice_kernel
finish_kernel = _finish_kernel

#: Elements per program of the finishing cast.
FINISH_BLOCK = 1024


@dataclass(frozen=True)
class FusedSliceLaunch:
    """One launch of the fused layer over ``tiles`` tiles of ``block_m`` slots."""

    hidden: int
    intermediate: int
    em: int
    num_valid: int
    top_k: int
    naive: bool
    block_m: int
    block_i: int
    block_k: int
    block_h: int
    num_warps: int
    num_stages: int
    compute_type: Any

    @property
    def grid(self) -> tuple[int]:
        return (-(-self.em // self.block_m) * -(-self.intermediate // self.block_i),)

    def args(
        self,
        x: Any,
        w1: Any,
        w2: Any,
        topk_weights: Any,
        acc: Any,
        sorted_ids: Any,
        expert_ids: Any,
        ntpp: Any,
    ) -> tuple[list[Any], dict[str, Any]]:
        """Positional and keyword arguments (tensors, or torch dtypes for ``warmup``).

        In the sparse mode ``expert_ids`` is the call's flattened ``topk_ids`` (one tile per
        slot) and ``sorted_ids`` is unused."""
        args = [
            x, w1, w2, topk_weights, acc, None if self.naive else sorted_ids, expert_ids, ntpp,
            self.hidden, self.intermediate, self.num_valid,
        ]  # fmt: skip
        kwargs = {
            "top_k": self.top_k,
            "NAIVE": self.naive,
            "compute_type": self.compute_type,
            "BLOCK_M": self.block_m,
            "BLOCK_I": self.block_i,
            "BLOCK_K": self.block_k,
            "BLOCK_H": self.block_h,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
        }
        return args, kwargs


def finish_grid(elements: int) -> tuple[int]:
    return (-(-elements // FINISH_BLOCK),)
