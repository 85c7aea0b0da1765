"""A streaming-read probe: a Triton kernel that reads a tensor once into float32 partial sums.

The memory-bound floor of a decode batch is its weight bytes over what the device can read;
a device-to-device copy also writes, and a torch reduction runs as a tree of launches, so
neither need reach the read limit.  Plain Triton, as mcTriton builds it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _stream_sum_kernel(src, partial, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """One float32 partial sum per program over ``ITERS`` consecutive blocks of ``src``."""
    base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        # streamed once: no reason to keep it in L1
        acc += tl.load(src + offs, mask=offs < n, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(partial + tl.program_id(0), tl.sum(acc, axis=0))


#: launch shapes the probe tries, (elements per block, blocks per program, warps): which one
#: keeps enough bytes in flight differs between devices
VARIANTS: tuple[tuple[int, int, int], ...] = (
    (4096, 16, 8),
    (8192, 8, 8),
    (16384, 4, 16),
    (2048, 32, 4),
    (8192, 16, 16),
)


def stream_sum(src: torch.Tensor, variant: tuple[int, int, int] = VARIANTS[0]) -> torch.Tensor:
    """The per-program float32 partial sums of a contiguous tensor, read once (the probe)."""
    block, iters, warps = variant
    n = src.numel()
    grid = (triton.cdiv(n, block * iters),)
    partial = torch.empty(grid[0], dtype=torch.float32, device=src.device)
    _stream_sum_kernel[grid](src, partial, n, BLOCK=block, ITERS=iters, num_warps=warps)
    return partial
