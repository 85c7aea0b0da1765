"""The configs a learned prediction chooses among, and the extra ones a sweep times.

The menu is fixed by the shape alone, so that the sweep that trains the model, the model's
answer at dispatch and the validation that checks it all see the same candidates:

* FlagGems' kernels with one config for both GEMMs (``CORE_TILES``): the tiles vLLM's tuner
  picked most often across its H200 tables, spread over every BLOCK_SIZE_M;
* ``fused_act`` with those of them that ``ACT_TILES`` names, GEMM1 at half its ``block_n``
  (its GEMM1 program reads a gate and an up tile);
* ``fused_slice`` on ``SLICE_TILES`` where the batch is small enough for it.

A sweep also times ``extras``: a few configs of vLLM's grid drawn per family, so that the model
sees configs off the menu too (the tuner ranks the whole grid with it).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np

from mxdb.configs import FUSED_SLICE_MAX_SLOTS, GemmConfig, KernelConfig
from mxdb.shapes import MoEShape

if TYPE_CHECKING:
    from mxdb.profiles import DeviceProfile

#: (block_m, block_n, block_k, group_m, num_warps, num_stages)
CORE_TILES: tuple[tuple[int, int, int, int, int, int], ...] = (
    (16, 32, 64, 1, 4, 4),
    (16, 64, 64, 1, 4, 4),
    (16, 64, 128, 1, 4, 3),
    (16, 128, 64, 1, 4, 3),
    (16, 128, 128, 1, 8, 3),
    (16, 256, 128, 1, 8, 2),
    (32, 128, 128, 1, 4, 3),
    (64, 64, 64, 1, 4, 3),
    (64, 128, 64, 1, 4, 3),
    (64, 128, 128, 1, 8, 4),
    (128, 128, 64, 1, 8, 3),
    (128, 256, 64, 1, 8, 4),
    (128, 256, 64, 16, 8, 4),
)
#: indices into ``CORE_TILES`` also run under ``fused_act``
ACT_TILES: tuple[int, ...] = (1, 3, 8, 10, 11)
#: ``fused_slice`` tiles: (slice width, hidden step, output chunk, warps, stages), block_m 16
#: (a spread of ``mxdb.tune.space.SLICE_TILES``)
SLICE_TILES: tuple[tuple[int, int, int, int, int], ...] = (
    (64, 64, 128, 4, 3),
    (64, 128, 256, 8, 3),
    (64, 256, 128, 4, 4),
    (128, 64, 256, 4, 3),
    (128, 128, 128, 8, 3),
    (128, 256, 256, 4, 4),
)
#: grid configs a sweep adds per family
EXTRAS = 6


def _gemm(t: tuple[int, int, int, int, int, int]) -> GemmConfig:
    bm, bn, bk, g, w, s = t
    return GemmConfig(
        block_m=bm, block_n=bn, block_k=bk, group_m=g, num_warps=w, num_stages=s
    )  # fmt: skip


def menu(shape: MoEShape) -> list[KernelConfig]:
    """The candidate configs at ``shape``, in a fixed order (no duplicates)."""
    out: dict[str, KernelConfig] = {}
    for t in CORE_TILES:
        c = KernelConfig.uniform(_gemm(t))
        out.setdefault(c.hash, c)
    for j in ACT_TILES:
        g = _gemm(CORE_TILES[j])
        half = g.model_copy(update={"block_n": g.block_n // 2})
        c = KernelConfig(gemm1=half, gemm2=g, align_block=g.block_m, impl="fused_act")
        out.setdefault(c.hash, c)
    if shape.tokens * shape.topk <= FUSED_SLICE_MAX_SLOTS:
        from mxdb.tune.space import slice_configs

        for c in slice_configs(shape, SLICE_TILES):
            out.setdefault(c.hash, c)
    return list(out.values())


def family_seed(family: str) -> int:
    """A seed drawn from a family's name (stable across processes and machines)."""
    return int.from_bytes(hashlib.sha256(f"costmodel|{family}".encode()).digest()[:4], "big")


def extras(
    shape: MoEShape, n: int = EXTRAS, profile: DeviceProfile | None = None
) -> list[KernelConfig]:
    """``n`` configs of vLLM's grid drawn for the shape's family (not on the menu), each one
    the resource proxy accepts on ``profile`` when one is given."""
    from mxdb.resources import check, vllm_grid

    grid = vllm_grid()
    rng = np.random.default_rng(family_seed(shape.family))
    taken = {c.hash for c in menu(shape)}
    out: list[KernelConfig] = []
    for j in rng.permutation(len(grid)).tolist():
        c = KernelConfig.uniform(grid[j])
        if c.hash not in taken and (profile is None or check(c, shape, profile).fits):
            out.append(c)
            taken.add(c.hash)
        if len(out) == n:
            break
    return out
