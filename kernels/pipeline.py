"""The fused-MoE layer on FlagGems 5.0.2's kernels, with an injected :class:`KernelConfig`.

One call runs, in order (DESIGN section 4):

1. ``moe_align_block_size`` at ``config.align_block``: token slots sorted by expert, each expert
   padded to a multiple of the alignment block (skipped in the sparse "naive" mode, below);
2. GEMM1 ``x[M,H] x w1[E,2I,H]`` with ``config.gemm1``;
3. ``silu(gate) * up``;
4. GEMM2 ``[M*k,I] x w2[E,H,I]`` times the routing weights, with ``config.gemm2``;
5. ``moe_sum`` over the k experts of each token.

Both GEMMs are FlagGems' own ``fused_moe_kernel``.  The launch is issued here rather than through
``invoke_fused_moe_triton_kernel`` because that helper derives the grid from the GEMM's own
``BLOCK_SIZE_M``: when ``align_block`` is larger than a GEMM's ``block_m``, its grid would be cut
short for small batches.  Here the alignment produces one expert id per ``align_block`` rows; a
GEMM with a smaller ``block_m`` gets an expanded copy (each alignment block covers
``align_block / block_m`` tiles) and a grid over the full padded length.  The padded length
(``num_tokens_post_padded``) is a multiple of ``align_block``, hence of every ``block_m``, so the
one value serves both GEMMs.

Sparse batches (``tokens * topk * 4 <= experts``) follow FlagGems: no alignment, one tile per token
slot ("naive block assignment"); ``align_block`` is then unused.

A config whose ``impl`` is ``fused_act`` runs mxdb's own alignment and GEMM1 instead
(:mod:`mxdb.kernels.fused_act`): one alignment launch that writes each GEMM's tile expert ids
directly (batches up to ``ONE_PASS_MAX_SLOTS`` slots; larger ones align as above), and a GEMM1
that writes ``silu(gate) * up`` so that step 3 disappears.  A config whose ``impl`` is
``fused_slice`` runs steps 2-5 as one kernel (:mod:`mxdb.kernels.fused_slice`) after the one-pass
alignment (none in the sparse mode), then casts its float32 accumulator into the output.

Every buffer is allocated once, at construction, for one token count; a call does no allocation,
no config lookup and no logging, so it can be captured in a CUDA graph.  The alignment runs
FlagGems' own four stage kernels (``moe_align_block_size_stage1`` .. ``stage4``, the path
``moe_align_block_size_triton`` takes without TLE) on preallocated scratch buffers instead of
the two tensors FlagGems allocates per call; one memset clears the counts.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from flag_gems.fused.fused_moe import MoEActivation, apply_moe_activation, fused_moe_kernel
from flag_gems.fused.moe_sum import moe_sum
from mxdb.kernels.fused_act import AlignLaunch, Gemm1ActLaunch, gemm1_act_kernel, one_pass_fits
from mxdb.kernels.fused_slice import (
    FINISH_BLOCK,
    FusedSliceLaunch,
    finish_grid,
    finish_kernel,
    fused_slice_kernel,
)

from mxdb.configs import GemmConfig, KernelConfig
from mxdb.shapes import MoEShape

# flag_gems.fused re-exports functions under its submodules' names: take the module itself
_mab = importlib.import_module("flag_gems.fused.moe_align_block_size")

#: FlagGems skips the alignment when token slots are this sparse over the experts.
SPARSITY_FACTOR = 4

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
COMPUTE_TYPES: dict[str, Any] = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}


def uses_naive_assignment(tokens: int, topk: int, experts: int) -> bool:
    """FlagGems' rule: sparse batches skip the alignment and give each token slot its own tile."""
    return tokens * topk * SPARSITY_FACTOR <= experts


def padded_length(slots: int, experts: int, align: int) -> int:
    """An upper bound of ``num_tokens_post_padded``, rounded up to ``align``.

    Each non-empty expert (at most ``min(experts, slots)``) adds fewer than ``align`` padding
    slots, and no expert pads to more than ``align`` slots per real slot.
    """
    bound = min(slots * align, slots + min(experts, slots) * (align - 1))
    return -(-bound // align) * align


@dataclass(frozen=True)
class GemmLaunch:
    """Everything about one GEMM launch that does not depend on the call's tensors."""

    which: str  # "gemm1" or "gemm2"
    n: int
    k: int
    em: int
    num_valid: int
    stride_am: int
    stride_be: int
    stride_bn: int
    stride_cm: int
    top_k: int
    mul_routed_weight: bool
    naive: bool
    gemm: GemmConfig
    dtype: str

    @property
    def grid(self) -> tuple[int]:
        g = self.gemm
        return (-(-self.em // g.block_m) * -(-self.n // g.block_n),)

    def args(
        self, a: Any, b: Any, c: Any, topk_weights: Any, sorted_ids: Any, expert_ids: Any, ntpp: Any
    ) -> tuple[list[Any], dict[str, Any]]:
        """Positional and keyword arguments of ``fused_moe_kernel`` (tensors or torch dtypes).

        Passing torch dtypes in place of tensors gives the arguments ``JITFunction.warmup``
        takes: the compile workers use this same function, so they fill the cache entry that
        the timing process later looks up.
        """
        g = self.gemm
        args = [
            a, b, c,
            None, None, None,  # bias, A scale, B scale
            topk_weights,
            None if self.naive else sorted_ids,
            expert_ids,
            ntpp,
            self.n, self.k, self.em, self.num_valid,
            self.stride_am, 1,  # stride_am, stride_ak
            self.stride_be, 1, self.stride_bn,  # stride_be, stride_bk, stride_bn
            self.stride_cm, 1,  # stride_cm, stride_cn
            0, 0, 0, 0, 0, 0, 0,  # scale and bias strides
            0, 0,  # group_n, group_k
        ]  # fmt: skip
        kwargs = {
            "MUL_ROUTED_WEIGHT": self.mul_routed_weight,
            "top_k": self.top_k,
            "compute_type": COMPUTE_TYPES[self.dtype],
            "use_fp8_w8a8": False,
            "use_int8_w8a8": False,
            "use_int8_w8a16": False,
            "per_channel_quant": False,
            "naive_block_assignment": self.naive,
            "HAS_BIAS": False,
            "BLOCK_SIZE_K": g.block_k,
            "SWAP_AB": False,
            "BLOCK_SIZE_M": g.block_m,
            "BLOCK_SIZE_N": g.block_n,
            "GROUP_SIZE_M": g.group_m,
            "SPLIT_K": 1,
            "num_warps": g.num_warps,
            "num_stages": g.num_stages,
        }
        return args, kwargs


def act_launch(g1: GemmLaunch, intermediate: int, hidden: int) -> Gemm1ActLaunch:
    """GEMM1 of the ``fused_act`` implementation, on the tiles and grid rows of ``g1``."""
    g = g1.gemm
    return Gemm1ActLaunch(
        intermediate=intermediate, hidden=hidden, em=g1.em, num_valid=g1.num_valid,
        top_k=g1.top_k, naive=g1.naive, block_m=g.block_m, block_n=g.block_n,
        block_k=g.block_k, group_m=g.group_m, num_warps=g.num_warps, num_stages=g.num_stages,
        compute_type=COMPUTE_TYPES[g1.dtype],
    )  # fmt: skip


def slice_launch(
    g1: GemmLaunch, g2: GemmLaunch, intermediate: int, hidden: int
) -> FusedSliceLaunch:
    """The ``fused_slice`` launch on the tiles and grid rows of ``g1`` (``block_h`` from ``g2``)."""
    g = g1.gemm
    return FusedSliceLaunch(
        hidden=hidden, intermediate=intermediate, em=g1.em, num_valid=g1.num_valid,
        top_k=g1.top_k, naive=g1.naive, block_m=g.block_m, block_i=g.block_n, block_k=g.block_k,
        block_h=g2.gemm.block_n, num_warps=g.num_warps, num_stages=g.num_stages,
        compute_type=COMPUTE_TYPES[g1.dtype],
    )  # fmt: skip


def gemm_launches(
    shape: MoEShape, config: KernelConfig, naive: bool | None = None
) -> tuple[GemmLaunch, GemmLaunch]:
    """The two GEMM launches of ``shape`` under ``config`` (pure arithmetic, no GPU)."""
    e, h, i, k, m = shape.experts, shape.hidden, shape.intermediate, shape.topk, shape.tokens
    if naive is None:
        naive = uses_naive_assignment(m, k, e)
    slots = m * k
    common = {"num_valid": slots, "naive": naive, "dtype": shape.dtype}

    def em(g: GemmConfig) -> int:
        return slots * g.block_m if naive else padded_length(slots, e, config.align_block)

    g1 = GemmLaunch(
        which="gemm1", n=2 * i, k=h, em=em(config.gemm1), stride_am=h, stride_be=2 * i * h,
        stride_bn=h, stride_cm=2 * i, top_k=k, mul_routed_weight=False, gemm=config.gemm1, **common,
    )  # fmt: skip
    g2 = GemmLaunch(
        which="gemm2", n=h, k=i, em=em(config.gemm2), stride_am=i, stride_be=h * i,
        stride_bn=i, stride_cm=h, top_k=1, mul_routed_weight=True, gemm=config.gemm2, **common,
    )  # fmt: skip
    return g1, g2


class MoEPipeline:
    """The MoE layer for one shape (token count included) and one config; buffers preallocated.

    ``pipeline(x, topk_weights, topk_ids)`` returns the ``[M, H]`` output buffer (overwritten by
    the next call) or writes into ``out``.  ``topk_ids`` must be contiguous; its dtype (int32 or
    int64) is part of the compiled kernel's key in the sparse mode.
    """

    def __init__(
        self,
        shape: MoEShape,
        config: KernelConfig,
        w1: torch.Tensor,
        w2: torch.Tensor,
        *,
        naive: bool | None = None,
    ) -> None:
        e, h, i, k, m = shape.experts, shape.hidden, shape.intermediate, shape.topk, shape.tokens
        dtype = TORCH_DTYPES[shape.dtype]
        if tuple(w1.shape) != (e, 2 * i, h) or tuple(w2.shape) != (e, h, i):
            raise ValueError(
                f"weights {tuple(w1.shape)}, {tuple(w2.shape)} do not match {shape!r}: "
                f"w1 must be {(e, 2 * i, h)} and w2 {(e, h, i)}"
            )
        if w1.dtype != dtype or w2.dtype != dtype:
            raise ValueError(f"weights are {w1.dtype}/{w2.dtype}; {shape!r} needs {dtype}")
        if not (w1.is_contiguous() and w2.is_contiguous()):
            raise ValueError("w1 and w2 must be contiguous")
        self.shape = shape
        self.config = config
        self.w1 = w1
        self.w2 = w2
        self.g1, self.g2 = gemm_launches(shape, config, naive)
        self.naive = self.g1.naive
        own_align = config.impl in ("fused_act", "fused_slice")
        self.act1 = act_launch(self.g1, i, h) if config.impl == "fused_act" else None
        self.slice = slice_launch(self.g1, self.g2, i, h) if config.impl == "fused_slice" else None
        #: whether two calls on the same inputs give bit-identical outputs (``fused_slice``'s
        #: atomic float32 sums add in a varying order)
        self.deterministic = self.slice is None
        dev = w1.device
        slots = m * k
        align = config.align_block
        i32 = torch.int32
        self.ntpp = torch.empty(1, dtype=i32, device=dev)
        # (destination, source) pairs that expand per-alignment-block expert ids to per-tile ids
        self._expand: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.one_pass: AlignLaunch | None = None
        if self.naive:
            # every tile index below slots * block_m is live; align >= both block_m
            self.ntpp.fill_(slots * align)
            self.sorted_ids: torch.Tensor | None = None
            self.align_expert_ids: torch.Tensor | None = None
            self._tile_ids: dict[str, torch.Tensor | None] = {"gemm1": None, "gemm2": None}
        elif own_align and one_pass_fits(slots):
            length = padded_length(slots, e, align)
            self.sorted_ids = torch.empty(length, dtype=i32, device=dev)
            self.align_expert_ids = None
            bm1, bm2 = config.gemm1.block_m, config.gemm2.block_m
            t1 = torch.empty(length // bm1, dtype=i32, device=dev)
            t2 = t1 if bm2 == bm1 else torch.empty(length // bm2, dtype=i32, device=dev)
            self._tile_ids = {"gemm1": t1, "gemm2": t2}
            self.one_pass = AlignLaunch(slots, e, align, bm1, bm2)
        else:
            length = padded_length(slots, e, align)
            self.sorted_ids = torch.empty(length, dtype=i32, device=dev)
            self.align_expert_ids = torch.empty(length // align, dtype=i32, device=dev)
            expanded: dict[int, torch.Tensor] = {}
            for g in (config.gemm1, config.gemm2):
                bm = g.block_m
                if bm != align and bm not in expanded:
                    buf = torch.empty(length // bm, dtype=i32, device=dev)
                    expanded[bm] = buf
                    src = self.align_expert_ids[:, None].expand(-1, align // bm)
                    self._expand.append((buf.view(-1, align // bm), src))
            self._tile_ids = {
                "gemm1": expanded.get(config.gemm1.block_m, self.align_expert_ids),
                "gemm2": expanded.get(config.gemm2.block_m, self.align_expert_ids),
            }
            # FlagGems' alignment scratch, allocated once: counts per (stage row, expert) and
            # the padded prefix sum; cumsum[0] is never written by the stages and stays 0
            self._cnts = torch.zeros((e + 1, e), dtype=i32, device=dev)
            self._cumsum = torch.zeros(e + 1, dtype=i32, device=dev)
            n_sorted, n_exp = length, length // align
            self._stage_consts = (
                triton.next_power_of_2(-(-slots // e)),  # tokens_per_thread
                triton.next_power_of_2(-(-n_sorted // e)),  # block_size_sorted
                triton.next_power_of_2(-(-n_exp // e)),  # block_size_expert
                triton.next_power_of_2(e),
                n_sorted,
                n_exp,
            )
            self._stage2 = (
                _mab.moe_align_block_size_stage2_vec
                if e == triton.next_power_of_2(e)
                else _mab.moe_align_block_size_stage2
            )
        # cache1 ([M, k, 2I]) and cache3 ([M, k, H]) are separate: no aliasing across calls;
        # fused_act's GEMM1 writes cache2 itself and has no cache1; fused_slice has none of
        # them, only a float32 accumulator that its finishing launch clears after each call
        staged = self.slice is None
        self.cache1 = torch.empty(
            (m, k, 2 * i if staged and self.act1 is None else 0), dtype=dtype, device=dev
        )
        self.cache2 = torch.empty((slots, i if staged else 0), dtype=dtype, device=dev)
        self.cache3 = torch.empty((m, k, h if staged else 0), dtype=dtype, device=dev)
        self.acc = torch.zeros((m, 0 if staged else h), dtype=torch.float32, device=dev)
        self.out = torch.empty((m, h), dtype=dtype, device=dev)
        self._cache1_2d = self.cache1.view(slots, -1)
        if self.slice is not None:
            self._a1, self._k1 = self.slice.args(
                None, w1, w2, None, self.acc, self.sorted_ids, self._tile_ids["gemm1"], self.ntpp
            )
            self._grid1 = self.slice.grid
        elif self.act1 is not None:
            self._a1, self._k1 = self.act1.args(
                None, w1, self.cache2, self.sorted_ids, self._tile_ids["gemm1"], self.ntpp
            )
            self._grid1 = self.act1.grid
        else:
            self._a1, self._k1 = self.g1.args(
                None, w1, self.cache1, None, self.sorted_ids, self._tile_ids["gemm1"], self.ntpp
            )
            self._grid1 = self.g1.grid
        self._a2, self._k2 = self.g2.args(
            self.cache2, w2, self.cache3, None, self.sorted_ids, self._tile_ids["gemm2"], self.ntpp
        )
        self._grid2 = self.g2.grid
        self._silu = MoEActivation.SILU

    def _align_stages(self, topk_ids: torch.Tensor) -> list[Callable[[], object]]:
        """FlagGems' alignment stage launches on this workspace's buffers (after the memset)."""
        e = self.shape.experts
        block = self.config.align_block
        tpt, bss, bse, e_pow2, n_sorted, n_exp = self._stage_consts
        slots = self.shape.tokens * self.shape.topk
        grid = (e,)
        cnts, cumsum, sids, eids = self._cnts, self._cumsum, self.sorted_ids, self.align_expert_ids
        stage2 = self._stage2
        return [
            lambda: _mab.moe_align_block_size_stage1[grid](
                topk_ids, cnts, e, slots, tpt, sids, eids, n_sorted, n_exp, bss, bse
            ),
            lambda: stage2[grid](cnts, e),
            lambda: _mab.moe_align_block_size_stage3[(1,)](
                self.ntpp, cnts, cumsum, e, e_pow2, block
            ),
            lambda: _mab.moe_align_block_size_stage4[grid](
                topk_ids, sids, eids, cnts, cumsum, e, block, slots, tpt
            ),
        ]

    def _align(self, topk_ids: torch.Tensor) -> list[tuple[str, Callable[[], object]]]:
        """The alignment's launches (none in the sparse mode)."""
        if self.naive:
            return []
        if self.one_pass is not None:
            sids, t1, t2 = self.sorted_ids, self._tile_ids["gemm1"], self._tile_ids["gemm2"]
            one = self.one_pass
            return [("triton", lambda: one.launch(topk_ids, sids, t1, t2, self.ntpp))]
        out: list[tuple[str, Callable[[], object]]] = [("torch", self._cnts.zero_)]
        out += [("triton", f) for f in self._align_stages(topk_ids)]
        out += [("torch", lambda d=d, s=s: d.copy_(s)) for d, s in self._expand]  # type: ignore[misc]
        return out

    def steps(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        out: torch.Tensor,
    ) -> list[tuple[str, Callable[[], object]]]:
        """The call's launches in order, as ``("torch" | "triton", thunk)`` pairs.

        ``kernels.layer`` records the Triton launches of each thunk once and replays them
        directly; the torch steps (the memset of the alignment counts, the expansion of expert
        ids per tile) are replayed as they are.
        """
        a1, a2 = self._bind(x, topk_weights, topk_ids)
        k1, k2, g1, g2 = self._k1, self._k2, self._grid1, self._grid2
        out_steps = self._align(topk_ids)
        if self.slice is not None:
            acc, n = self.acc, self.acc.numel()
            fin = finish_grid(n)
            out_steps.append(("triton", lambda: fused_slice_kernel[g1](*a1, **k1)))
            out_steps.append(
                ("triton", lambda: finish_kernel[fin](acc, out, n, BLOCK=FINISH_BLOCK))
            )
            return out_steps
        if self.act1 is not None:
            out_steps.append(("triton", lambda: gemm1_act_kernel[g1](*a1, **k1)))
        else:
            out_steps += [
                ("triton", lambda: fused_moe_kernel[g1](*a1, **k1)),
                ("triton", lambda: apply_moe_activation(self._silu, self.cache2, self._cache1_2d)),
            ]
        out_steps += [
            ("triton", lambda: fused_moe_kernel[g2](*a2, **k2)),
            ("triton", lambda: moe_sum(self.cache3, out)),
        ]
        return out_steps

    def _bind(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> tuple[list[Any], list[Any]]:
        """GEMM1's and GEMM2's argument lists with this call's tensors."""
        a1, a2 = list(self._a1), list(self._a2)
        a1[0], a2[6] = x, topk_weights
        if self.slice is not None:
            a1[3] = topk_weights
            if self.naive:
                a1[6] = topk_ids
        elif self.act1 is not None:
            if self.naive:
                a1[4] = topk_ids
        else:
            a1[6] = topk_weights
            if self.naive:
                a1[8] = topk_ids
        if self.naive:
            a2[8] = topk_ids
        return a1, a2

    def __call__(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        result = self.out if out is None else out
        for _, launch in self.steps(x, topk_weights, topk_ids, result):
            launch()
        return result
