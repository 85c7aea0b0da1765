"""The resource proxy (DESIGN section 7): will a fused-MoE GEMM config fit the device?

It estimates, without compiling, the shared memory and registers one of the
two grouped GEMMs of the fused-MoE kernel needs under a Triton tile config,
and checks them against a ``DeviceProfile``.  It also restates the two configs
the tuner starts from: FlagGems 5.0.2's default heuristic and vLLM's grid.

Shared memory.  Triton's software pipeliner keeps the A tile
(``BLOCK_M x BLOCK_K``) and the B tile (``BLOCK_K x BLOCK_N``) of each
pipelined iteration in shared memory.  Triton 3.x allocates ``distToUse``
buffers per load, which is ``num_stages - 1`` for loads that feed the dot
directly, plus one more when the dot lowers to Hopper's warp-group MMA
(``createAsyncOps`` in lib/Dialect/TritonGPU/Transforms/Pipeliner/
MatmulLoopPipeline.cpp: "for MMAv3, we need an extra buffer").  Triton takes
the wgmma path on sm_90 when ``BLOCK_M % 64 == 0`` and ``num_warps % 4 == 0``;
with ``num_stages = 1`` nothing is pipelined and the tiles still pass through
one buffer.  So, on NVIDIA::

    smem = (BLOCK_M * BLOCK_K + BLOCK_K * BLOCK_N) * bytes_per_elem * buffers
    buffers = num_stages                 if wgmma
              max(1, num_stages - 1)     otherwise

This matched the shared memory Triton 3.6.0 reported for all 97 configs of a
fused-MoE-style grouped GEMM (gathered A rows, per-expert B) compiled on an
H200, out-of-resource ones included; the epilogue's layout conversion reuses
the pipeline's memory and never set the total.

On the MetaX C500 (profile rule ``mctriton``): ``buffers = max(1, num_stages - 1)``
(the C500 has no wgmma).  Calibrated on the one compile failure recorded on a real C500
(C500 M0 milestone: MXMACA 3.5.3.20, FlagGems 5.0.2, shape M=4 E=8 H=4096 I=14336 k=2,
fp16): for FlagGems' default config M16/N128/K128/G1/w4/s3 mcTriton asked for 73,728 B =
2 x (16x128 + 128x128) x 2 B, above the 65,536 B limit; the milestone's safe anchor
M16/N128/K64/w4/s2 (18,432 B) and its best config M16/N32/K64/w4/s2 (6,144 B) compiled
and ran.  What is still an assumption: that the rule holds at other num_stages, tile sizes
and for bf16 (one failing and two passing configs were recorded, all at BLOCK_M 16), and
that nothing else (epilogue, layout conversion) ever needs more.  Profiles of compilers
never measured use ``buffers = num_stages``, the upper bound.

Registers.  The fp32 accumulator takes ``BLOCK_M * BLOCK_N / threads``
registers per thread; ``acc + 0.75 * operand tile words per thread + 24``
fitted the register counts of the same compiled configs (mean error about 11
registers).  An estimate above the per-thread limit is a warning (expect
spills).  A config whose accumulator alone exceeds the limit is rejected, except
on NVIDIA: there ptxas spills to local memory instead of failing, and every such
config of the vLLM grid compiled on an H200 under Triton 3.6.0 (255 registers,
158 to 796 spilled), so it is a warning there too.

Known compiler failures.  Some configs fit the device and still fail to
compile.  ``KNOWN_COMPILE_FAILURES`` lists the ones measured, each scoped to
the Triton release, architecture, dtype and GEMM it was measured on, and the
proxy rejects a config that matches one (``ResourceEstimate.known_failure``
names the rule).  The rules apply when the caller names that Triton release
(``triton="3.6.0"``) or names none (the built-in H200 profile was measured on
Triton 3.6.0); a caller that names another release skips them.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from pydantic import BaseModel, ConfigDict

from mxdb.configs import GemmConfig, KernelConfig
from mxdb.errors import UsageError
from mxdb.profiles import DeviceProfile
from mxdb.shapes import DTYPE_BYTES, MoEShape, canonical_dtype

#: Triton's tl.dot needs every tile dimension to be at least 16.
MIN_DOT_DIM = 16
#: Register estimate: fixed overhead (indices, pointers, masks) and operand weight.
REG_OVERHEAD = 24
REG_OPERAND_WEIGHT = 0.75

#: FlagGems 5.0.2 routes both GEMMs through one config; calls are chunked at this M.
FLAGGEMS_CHUNK_SIZE = 16 * 1024


class KnownCompileFailure(BaseModel):
    """A measured compiler failure of configs that fit the device, and where it was measured."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    triton: str  # major.minor of the Triton release that failed
    arch: str
    dtypes: tuple[str, ...]
    gemm_index: int
    block_m: int
    num_warps: int
    block_nk: tuple[tuple[int, int], ...]  # (BLOCK_N, BLOCK_K) pairs that failed
    num_stages: tuple[int, ...]
    error: str
    evidence: str

    def matches(
        self,
        gemm: GemmConfig,
        *,
        dtype: str,
        profile: DeviceProfile,
        gemm_index: int,
        triton: str | None,
    ) -> bool:
        if triton is not None and _major_minor(triton) != self.triton:
            return False
        return (
            profile.arch == self.arch
            and dtype in self.dtypes
            and gemm_index == self.gemm_index
            and gemm.block_m == self.block_m
            and gemm.num_warps == self.num_warps
            and (gemm.block_n, gemm.block_k) in self.block_nk
            and gemm.num_stages in self.num_stages
        )


def _major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


#: Measured compiler failures (see ``KnownCompileFailure``); one entry per failure seen.
KNOWN_COMPILE_FAILURES: tuple[KnownCompileFailure, ...] = (
    KnownCompileFailure(
        id="triton36-sm90-m256-w4-square",
        triton="3.6",
        arch="sm_90",
        dtypes=("bf16",),
        gemm_index=1,
        block_m=256,
        num_warps=4,
        block_nk=((64, 64), (128, 128), (256, 256)),
        num_stages=(2, 3, 4, 5),
        error="MLIR pass failure 'operand #0 does not dominate this use' (PassManager::run "
        "failed) in FlagGems 5.0.2's fused_moe_kernel",
        evidence="evidence/h200-compile-survey: all 12 such compiles of vLLM's grid failed on "
        "an H200 (Triton 3.6.0, bf16, GEMM1); every other BLOCK_M 256 / 4-warp config compiled "
        "or ran out of shared memory",
    ),
)


class ResourceEstimate(BaseModel):
    """What one GEMM of the fused-MoE layer needs under one config, and whether it fits."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gemm_index: int
    config: str
    profile: str
    smem_bytes: int
    smem_limit: int
    smem_buffers: int
    regs_per_thread_est: int
    acc_regs_per_thread: int
    regs_limit: int
    threads: int
    threads_limit: int
    fits: bool
    reasons: list[str]
    warnings: list[str]
    known_failure: str | None = None  # the id of a matched KNOWN_COMPILE_FAILURES rule


class CheckResult(BaseModel):
    """Both GEMMs of a fused-MoE layer config checked against one device profile."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    profile: str
    shape: dict[str, Any]
    config: dict[str, Any]
    gemm1: ResourceEstimate
    gemm2: ResourceEstimate
    fits: bool

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()


def uses_wgmma(gemm: GemmConfig, profile: DeviceProfile) -> bool:
    """Whether Triton lowers this GEMM's dot to Hopper warp-group MMA on ``profile``."""
    return profile.wgmma and gemm.block_m % 64 == 0 and gemm.num_warps % 4 == 0


def smem_buffers(gemm: GemmConfig, profile: DeviceProfile) -> int:
    """Shared-memory copies of the A and B tiles Triton keeps (see the module docstring)."""
    if profile.smem_buffer_rule == "num_stages":
        return gemm.num_stages
    if profile.smem_buffer_rule == "mctriton":
        return max(1, gemm.num_stages - 1)
    if uses_wgmma(gemm, profile):
        return gemm.num_stages
    return max(1, gemm.num_stages - 1)


def _gemm_dims(shape: MoEShape, gemm_index: int) -> tuple[int, int]:
    """(N, K) of a GEMM: GEMM1 is [M, H] x [H, 2I], GEMM2 is [M*k, I] x [I, H]."""
    if gemm_index == 1:
        return 2 * shape.intermediate, shape.hidden
    return shape.hidden, shape.intermediate


def estimate(
    gemm: GemmConfig,
    *,
    dtype: object,
    profile: DeviceProfile,
    gemm_index: int = 1,
    shape: MoEShape | None = None,
    triton: str | None = None,
    weight_tiles: int = 1,
) -> ResourceEstimate:
    """Shared memory, registers and threads of one GEMM config on ``profile``.

    ``weight_tiles`` is 2 for the ``fused_act`` and ``fused_slice`` GEMM1, whose program loads a
    gate and an up tile of the weights and keeps an accumulator for each.  ``shape`` (optional) only adds warnings about tiles larger than the GEMM.  ``triton``
    (optional) is the Triton release the config will be compiled with: it selects the
    ``KNOWN_COMPILE_FAILURES`` that apply (all of them when not given).
    """
    if gemm_index not in (1, 2):
        raise UsageError(f"gemm_index must be 1 or 2, got {gemm_index!r}")
    dtype_name = canonical_dtype(dtype)
    nbytes = DTYPE_BYTES[dtype_name]
    bm, bn, bk = gemm.block_m, gemm.block_n, gemm.block_k
    buffers = smem_buffers(gemm, profile)
    wn = weight_tiles * bn
    smem = (bm * bk + bk * wn) * nbytes * buffers
    threads = gemm.num_warps * profile.warp_size
    acc_regs = math.ceil(bm * wn / threads)
    operand_words = (bm * bk + bk * wn) * nbytes / 4 / threads
    regs = math.ceil(acc_regs + REG_OPERAND_WEIGHT * operand_words + REG_OVERHEAD)

    reasons: list[str] = []
    warnings: list[str] = []
    if smem > profile.smem_per_block:
        reasons.append(
            f"needs {smem:,} B of shared memory ({buffers} x ({bm}x{bk} + {bk}x{wn}) x "
            f"{nbytes} B), above the {profile.smem_per_block:,} B per block of {profile.name}"
        )
    if threads > profile.max_threads_per_block:
        reasons.append(
            f"{gemm.num_warps} warps x {profile.warp_size} = {threads} threads, above "
            f"{profile.max_threads_per_block} per block"
        )
    if acc_regs > profile.regs_per_thread and profile.vendor == "nvidia":
        # measured: ptxas spills rather than failing (see the module docstring)
        warnings.append(
            f"the fp32 accumulator alone needs {acc_regs} registers per thread, above the "
            f"limit of {profile.regs_per_thread}: compiles with heavy spills"
        )
    elif acc_regs > profile.regs_per_thread:
        reasons.append(
            f"the fp32 accumulator alone needs {acc_regs} registers per thread, above the "
            f"limit of {profile.regs_per_thread}"
        )
    elif regs > profile.regs_per_thread:
        warnings.append(
            f"about {regs} registers per thread estimated, above {profile.regs_per_thread}: "
            "expect spills"
        )
    small = [
        f"{n}={v}"
        for n, v in (("BLOCK_M", bm), ("BLOCK_N", bn), ("BLOCK_K", bk))
        if v < MIN_DOT_DIM
    ]
    if small:
        reasons.append(f"tl.dot needs tiles of at least {MIN_DOT_DIM}; got {', '.join(small)}")
    known = next(
        (
            rule
            for rule in KNOWN_COMPILE_FAILURES
            if rule.matches(
                gemm, dtype=dtype_name, profile=profile, gemm_index=gemm_index, triton=triton
            )
        ),
        None,
    )
    if known is not None:
        reasons.append(
            f"known Triton {known.triton} compile failure on {known.arch}: {known.error}"
        )
    if shape is not None:
        n_dim, k_dim = _gemm_dims(shape, gemm_index)
        if bk > k_dim:
            warnings.append(f"BLOCK_K {bk} exceeds the GEMM's K = {k_dim}: wasted work")
        if bn > n_dim:
            warnings.append(f"BLOCK_N {bn} exceeds the GEMM's N = {n_dim}: wasted work")
    return ResourceEstimate(
        gemm_index=gemm_index,
        config=gemm.short(),
        profile=profile.name,
        smem_bytes=smem,
        smem_limit=profile.smem_per_block,
        smem_buffers=buffers,
        regs_per_thread_est=regs,
        acc_regs_per_thread=acc_regs,
        regs_limit=profile.regs_per_thread,
        threads=threads,
        threads_limit=profile.max_threads_per_block,
        fits=not reasons,
        reasons=reasons,
        warnings=warnings,
        known_failure=known.id if known is not None else None,
    )


def check(
    config: KernelConfig | GemmConfig | Any,
    shape: MoEShape,
    profile: DeviceProfile,
    *,
    triton: str | None = None,
) -> CheckResult:
    """Check both GEMMs of a layer config (any form ``KernelConfig.parse`` accepts)."""
    if isinstance(config, GemmConfig):
        kc = KernelConfig.uniform(config)
    else:
        kc = KernelConfig.parse(config)
    kw: dict[str, Any] = {"dtype": shape.dtype, "profile": profile, "shape": shape}
    # fused_act's GEMM1 and fused_slice's first product load a gate and an up tile; the
    # second product of fused_slice is gemm2's tiles ([block_m, block_i] x [block_i, block_h])
    tiles1 = 2 if kc.impl in ("fused_act", "fused_slice") else 1
    g1 = estimate(kc.gemm1, gemm_index=1, triton=triton, weight_tiles=tiles1, **kw)
    g2 = estimate(kc.gemm2, gemm_index=2, triton=triton, **kw)
    return CheckResult(
        profile=profile.name,
        shape=shape.to_dict(),
        config=kc.model_dump(),
        gemm1=g1,
        gemm2=g2,
        fits=g1.fits and g2.fits,
    )


def check_config(config: Any, shape: MoEShape, *, profile: str) -> CheckResult:
    """``mxdb check-config``: resolve the profile by name, check the config at ``shape``."""
    from mxdb.profiles import resolve_profile

    return check(config, shape, resolve_profile(profile))


def flaggems_default_config(shape: MoEShape) -> GemmConfig:
    """The config FlagGems 5.0.2 picks for an unquantized fused-MoE call without a table entry.

    FlagGems 5.0.2 ships no MoE table for NVIDIA H200 or MetaX C500, so
    ``try_get_optimal_moe_config`` falls back to ``get_default_config(M, E, N,
    K, topk, dtype)`` with ``N = w2.shape[2] = I``, ``K = w1.shape[2] = H`` and
    ``M = min(tokens, 16384)``.  Restated (non-fp8 path):

    - tokens per expert ``t = M // E``: BLOCK_SIZE_M 16 if t <= 2, 32 if t <= 4,
      64 if t <= 16, else 128;
    - BLOCK_SIZE_N: for N >= 4096, 128 if M <= 128 else 256; otherwise 64 if
      M <= 64 else 128;
    - BLOCK_SIZE_K: 128 if M <= 64 else 64;
    - GROUP_SIZE_M: 16 if t > 128, 8 if t > 32, else 1;
    - num_warps 4 if M <= 128 else 8; num_stages 3, lowered (not below 2) while
      ``num_stages * (BLOCK_M*BLOCK_K + BLOCK_K*BLOCK_N) * 2 > 200,000``.

    C500 M0 shape (M=4, E=8, H=4096, I=14336, k=2): t = 0, N = 14336, so
    M16/N128/K128/G1/w4/s3.  Its estimate (2 buffers of (16x128 + 128x128) x 2 B) is
    73,728 B on the C500, which mcTriton reported there (above 65,536 B), and on the H200
    (no wgmma at BLOCK_M 16), which Triton 3.6 reported too.
    """
    m = min(shape.tokens, FLAGGEMS_CHUNK_SIZE)
    n = shape.intermediate  # the heuristic does not use K = H
    t = m // max(shape.experts, 1)
    block_m = 16 if t <= 2 else 32 if t <= 4 else 64 if t <= 16 else 128
    if n >= 4096:  # noqa: SIM108  (kept as two branches, like the heuristic it restates)
        block_n = 128 if m <= 128 else 256
    else:
        block_n = 64 if m <= 64 else 128
    block_k = 128 if m <= 64 else 64
    group_m = 16 if t > 128 else 8 if t > 32 else 1
    num_warps = 4 if m <= 128 else 8
    num_stages = 3
    per_stage = (block_m * block_k + block_k * block_n) * 2
    while num_stages > 2 and per_stage * num_stages > 200_000:
        num_stages -= 1
    return GemmConfig(
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        group_m=group_m,
        num_warps=num_warps,
        num_stages=num_stages,
    )


#: vLLM's tuning grid for NVIDIA (benchmarks/kernels/benchmark_moe.py,
#: get_configs_compute_bound): 5 x 4 x 3 x 4 x 2 x 4 = 1,920 configs.
VLLM_GRID: dict[str, tuple[int, ...]] = {
    "block_m": (16, 32, 64, 128, 256),
    "block_n": (32, 64, 128, 256),
    "block_k": (64, 128, 256),
    "group_m": (1, 16, 32, 64),
    "num_warps": (4, 8),
    "num_stages": (2, 3, 4, 5),
}


def vllm_grid() -> list[GemmConfig]:
    """vLLM's 1,920-config grid, in vLLM's order (BLOCK_SIZE_M outermost, num_stages innermost)."""
    keys = list(VLLM_GRID)
    return [
        GemmConfig(**dict(zip(keys, values, strict=True)))
        for values in itertools.product(*VLLM_GRID.values())
    ]
