"""mxdb's own fused-MoE kernels: a one-pass alignment and GEMM1 with SiLU-and-mul in its epilogue.

The ``fused_act`` implementation (:data:`mxdb.configs.IMPLS`) differs from FlagGems' layer in
two places (the stage profile, ``evidence/h200-stages``, shows why):

* **One-pass alignment.**  FlagGems aligns in a memset and four stage kernels (7-11 us on an
  H200 at every batch that aligns), and mxdb's pipeline then copies the expert ids once per
  GEMM tile size.  :func:`align_one_pass` is one launch of one program per expert: each program
  histograms every slot's expert (``tl.histogram``), takes its offset from the padded counts of
  the experts before it, scatters its own slots in slot order (a prefix sum of its mask), fills
  its padding with the sentinel and writes its expert id once per GEMM1 tile and once per GEMM2
  tile.  Each program reads every slot, so it serves batches up to :data:`ONE_PASS_MAX_SLOTS`
  token slots; larger ones keep FlagGems' staged alignment.
* **GEMM1 applies the activation.**  Each program computes a gate tile (rows ``n`` of ``w1``)
  and the matching up tile (rows ``I + n``) over the same activations and writes
  ``silu(gate) * up`` as the ``[M*k, I]`` input of GEMM2.  The ``[M*k, 2I]`` intermediate is
  never written nor read back, and the activation launch disappears.  A config's GEMM1
  ``block_n`` is the width of the output tile (the program reads ``2 * block_n`` weight rows).
  The activation is taken of the float32 accumulators (FlagGems rounds GEMM1's output to the
  layer dtype first), so results differ from FlagGems' in the last bits; both are checked
  against the float32 reference.

GEMM2 and the sum over the top-k slots stay FlagGems' kernels.  Everything is plain Triton (no
NVIDIA-only intrinsics), so it builds wherever Triton's ``tl.dot`` and ``tl.histogram`` do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import triton
import triton.language as tl

#: Batches with more token slots (tokens x top-k) keep FlagGems' staged alignment.
ONE_PASS_MAX_SLOTS = 8192


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@triton.jit
def _align_one_pass_kernel(
    topk_ids_ptr,
    sorted_ids_ptr,
    tile_ids1_ptr,
    tile_ids2_ptr,
    ntpp_ptr,
    num_slots,
    num_experts,
    SLOTS_P2: tl.constexpr,
    BINS: tl.constexpr,
    ALIGN: tl.constexpr,
    BM1: tl.constexpr,
    BM2: tl.constexpr,
    TILES1: tl.constexpr,
    TILES2: tl.constexpr,
):
    e = tl.program_id(0)
    offs = tl.arange(0, SLOTS_P2)
    valid = offs < num_slots
    # lanes past the batch count in bin `num_experts`, which no program owns
    ids = tl.load(topk_ids_ptr + offs, mask=valid, other=num_experts).to(tl.int32)
    counts = tl.histogram(ids, BINS)
    bins = tl.arange(0, BINS)
    padded = tl.where(bins < num_experts, (counts + ALIGN - 1) // ALIGN * ALIGN, 0)
    start = tl.sum(tl.where(bins < e, padded, 0), axis=0)
    count = tl.sum(tl.where(bins == e, counts, 0), axis=0)
    span = (count + ALIGN - 1) // ALIGN * ALIGN
    mine = ids == e
    rank = tl.cumsum(mine.to(tl.int32), axis=0) - 1
    tl.store(sorted_ids_ptr + start + rank, offs, mask=mine)
    pad = tl.arange(0, ALIGN)
    tl.store(sorted_ids_ptr + start + count + pad, num_slots, mask=count + pad < span)
    t1 = tl.arange(0, TILES1)
    tl.store(tile_ids1_ptr + start // BM1 + t1, e, mask=t1 < span // BM1)
    t2 = tl.arange(0, TILES2)
    tl.store(tile_ids2_ptr + start // BM2 + t2, e, mask=t2 < span // BM2)
    if e == 0:
        tl.store(ntpp_ptr, tl.sum(padded, axis=0))


@dataclass(frozen=True)
class AlignLaunch:
    """The one-pass alignment of ``slots`` token slots over ``experts`` experts."""

    slots: int
    experts: int
    align: int
    bm1: int
    bm2: int

    @property
    def grid(self) -> tuple[int]:
        return (self.experts,)

    def constexprs(self) -> dict[str, int]:
        # an expert's span is at most its slots rounded up to the alignment block
        span = -(-self.slots // self.align) * self.align
        return {
            "SLOTS_P2": next_pow2(self.slots),
            "BINS": next_pow2(self.experts + 1),
            "ALIGN": self.align,
            "BM1": self.bm1,
            "BM2": self.bm2,
            "TILES1": next_pow2(span // self.bm1),
            "TILES2": next_pow2(span // self.bm2),
            "num_warps": 4 if self.slots <= 2048 else 8,
        }

    def launch(
        self, topk_ids: Any, sorted_ids: Any, tile_ids1: Any, tile_ids2: Any, ntpp: Any
    ) -> None:
        _align_one_pass_kernel[self.grid](
            topk_ids, sorted_ids, tile_ids1, tile_ids2, ntpp, self.slots, self.experts,
            **self.constexprs(),
        )  # fmt: skip


def one_pass_fits(slots: int) -> bool:
    """Whether a batch of ``slots`` token slots is aligned in one pass."""
    return slots <= ONE_PASS_MAX_SLOTS


@triton.jit
def _gemm1_act_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    ntpp_ptr,
    N,
    K,
    EM,
    num_valid,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    top_k: tl.constexpr,
    NAIVE: tl.constexpr,
    compute_type: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(EM, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    in_group = GROUP_SIZE_M * num_pid_n
    first_m = (pid // in_group) * GROUP_SIZE_M
    group_m = min(num_pid_m - first_m, GROUP_SIZE_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m
    if pid_m * BLOCK_SIZE_M >= tl.load(ntpp_ptr):
        return
    rows = tl.arange(0, BLOCK_SIZE_M)
    if NAIVE:
        # one token slot per tile (FlagGems' sparse mode): row 0 is slot pid_m
        slot = tl.where(rows == 0, pid_m, num_valid)
    else:
        slot = tl.load(sorted_ids_ptr + pid_m * BLOCK_SIZE_M + rows)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    row_ok = slot < num_valid
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + (slot // top_k).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    g_ptrs = b_ptr + expert * stride_be + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]
    u_ptrs = g_ptrs + N * stride_bn
    acc_g = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        k_ok = offs_k < K - kk * BLOCK_SIZE_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & n_ok[None, :]
        g = tl.load(g_ptrs, mask=w_ok, other=0.0)
        u = tl.load(u_ptrs, mask=w_ok, other=0.0)
        acc_g = tl.dot(a, g, acc=acc_g)
        acc_u = tl.dot(a, u, acc=acc_u)
        a_ptrs += BLOCK_SIZE_K
        g_ptrs += BLOCK_SIZE_K
        u_ptrs += BLOCK_SIZE_K
    y = acc_g * tl.sigmoid(acc_g) * acc_u
    c_ptrs = c_ptr + slot.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, y.to(compute_type), mask=row_ok[:, None] & n_ok[None, :])


#: The GEMM1 kernel of the ``fused_act`` implementation (compile workers warm it up).
gemm1_act_kernel = _gemm1_act_kernel


@dataclass(frozen=True)
class Gemm1ActLaunch:
    """One launch of GEMM1 with the SiLU-and-mul epilogue: ``[M*k, H] x w1 -> [M*k, I]``."""

    intermediate: int
    hidden: int
    em: int
    num_valid: int
    top_k: int
    naive: bool
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    compute_type: Any

    @property
    def grid(self) -> tuple[int]:
        return (-(-self.em // self.block_m) * -(-self.intermediate // self.block_n),)

    def args(
        self, a: Any, w1: Any, c: Any, sorted_ids: Any, expert_ids: Any, ntpp: Any
    ) -> tuple[list[Any], dict[str, Any]]:
        """Positional and keyword arguments (tensors, or torch dtypes for ``warmup``)."""
        h, i = self.hidden, self.intermediate
        args = [
            a, w1, c, None if self.naive else sorted_ids, expert_ids, ntpp,
            i, h, self.em, self.num_valid,
            h, 2 * i * h, h, i,  # stride_am, stride_be, stride_bn, stride_cm
        ]  # fmt: skip
        kwargs = {
            "top_k": self.top_k,
            "NAIVE": self.naive,
            "compute_type": self.compute_type,
            "BLOCK_SIZE_M": self.block_m,
            "BLOCK_SIZE_N": self.block_n,
            "BLOCK_SIZE_K": self.block_k,
            "GROUP_SIZE_M": self.group_m,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
        }
        return args, kwargs
