"""A CPU stand-in for the GPU: an analytic cost model of the fused-MoE layer with seeded noise.

``FakeBackend`` implements :class:`mxdb.tune.backend.Backend` without a GPU, so that the
search, verification, work claiming and evidence can be tested anywhere.  Its layer time is a
roofline-style model on H200-like constants:

- each GEMM pays the larger of its weight-read time (active experts' weights, re-read per
  M-tile beyond L2 reuse, at a bandwidth that grows with the bytes in flight per SM and with the
  number of concurrent tiles) and its compute time (padded token slots: the routing's
  per-expert counts rounded up to the alignment block, so padding waste is real);
- wave quantization and an occupancy limit from shared memory, warps and registers;
- a deterministic per-config "quirk" factor of a few percent so that the landscape is rugged;
- fixed costs for alignment, activation, the top-k sum and launches.

Every sample is multiplied by seeded log-normal noise.  Failures can be injected (wrong
results, timeouts, compile errors, by config hash); configs whose shared memory exceeds the
profile fail with "oor", and a small deterministic rule marks some configs ``compile_error``.
The backend counts calls and simulated GPU and compile time (``clock()``), so that a benchmark
can compare the search's cost with an exhaustive one.
"""

from __future__ import annotations

import hashlib
import math
import time as _time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from mxdb.configs import IMPLS, GemmConfig, KernelConfig
from mxdb.evidence.thresholds import THRESHOLDS
from mxdb.models import Fingerprint
from mxdb.results import CompileResult, Correctness, Timing
from mxdb.shapes import DTYPE_BYTES, MoEShape

if TYPE_CHECKING:
    from mxdb.profiles import DeviceProfile

#: H200-like constants of the model.
BANDWIDTH_B_PER_S = 4.0e12
PEAK_FLOPS = 700e12
SMS = 132
SMEM_PER_SM = 228 * 1024
SMEM_PER_BLOCK = 227 * 1024
MAX_WARPS_PER_SM = 64
REGS_PER_SM = 65536
#: GPU calls spent on warm-up and graph capture for every config a time() call measures.
OVERHEAD_CALLS = 5
#: Fixed GPU seconds per config timed (graph capture, allocation, synchronization).
OVERHEAD_S = 2e-4
#: Simulated host seconds to compile one config, and the parallelism of the host.
COMPILE_S = 0.6
COMPILE_WORKERS = 16


def _unit(*parts: object) -> float:
    """A deterministic number in [0, 1) from ``parts``."""
    digest = hashlib.sha256("|".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def smem_bytes(g: GemmConfig, dtype: str) -> int:
    """Shared memory one block of a GEMM config needs: A and B tiles times pipeline stages."""
    return (g.block_m * g.block_k + g.block_k * g.block_n) * DTYPE_BYTES[dtype] * g.num_stages


def _is_compile_error(g: GemmConfig) -> bool:
    # a deterministic stand-in for configs that fail in the compiler (register allocation)
    return g.block_m * g.block_n >= 128 * 256 and g.num_warps == 4 and g.group_m == 64


@dataclass
class FakeCounters:
    """What the fake device has been asked to do."""

    compile_calls: int = 0
    configs_compiled: int = 0
    compiled_hashes: set[str] = field(default_factory=set)
    time_calls: int = 0
    configs_timed: int = 0
    layer_calls: int = 0
    check_calls: int = 0
    gpu_seconds: float = 0.0
    compile_seconds: float = 0.0


class FakeBackend:
    """An analytic, seeded, failure-injectable backend (see the module docstring)."""

    name = "fake"
    #: layer implementations it models (``fused_act``: no activation pass, a cheaper alignment)
    impls: tuple[str, ...] = IMPLS

    def __init__(
        self,
        *,
        seed: int = 0,
        noise: float = 0.01,
        wrong: Sequence[str] = (),
        timeouts: Sequence[str] = (),
        compile_errors: Sequence[str] = (),
        device_name: str = "FAKE_H200",
        sleep_per_time_call_s: float = 0.0,
        baseline: KernelConfig | None = None,
        overhead_s: float = OVERHEAD_S,
        calls_per_sample: int = 1,
        compile_startup_s: float = 0.0,
        round_drift: float = 0.0,
        position_bias: float = 0.0,
    ) -> None:
        self.seed = seed
        self.noise = noise
        # a log-normal factor shared by every config of one round (clock and load drift that
        # the paired verdict cancels), and a slowdown per position within a round (what a
        # fixed interleaving order turns into a bias; a random order per round spreads it)
        self.round_drift = round_drift
        self.position_bias = position_bias
        self.wrong = frozenset(wrong)
        self.timeouts = frozenset(timeouts)
        self.compile_errors = frozenset(compile_errors)
        self.device_name = device_name
        # real seconds slept per time() call: lets process tests kill a worker mid-point
        self.sleep_per_time_call_s = sleep_per_time_call_s
        self._baseline = baseline
        # GPU seconds per config timed beyond its replays (an H200 spends ~20 ms on pipeline
        # set-up, the correctness pre-check and graph capture), and layer calls per sample
        self.overhead_s = overhead_s
        self.calls_per_sample = calls_per_sample
        # real seconds the first compile() call sleeps: a compile pool starting up
        self.compile_startup_s = compile_startup_s
        self.counters = FakeCounters()

    # -- the Backend protocol -------------------------------------------------------------

    def fingerprint(self) -> Fingerprint:
        from mxdb.version import __version__

        return Fingerprint(
            vendor="fake",
            device_name=self.device_name,
            arch="sim90",
            sm_count=SMS,
            smem_per_block=SMEM_PER_BLOCK,
            warp_size=32,
            driver="fake-1",
            toolkit="fake-1",
            torch=None,
            triton=None,
            flag_gems=None,
            kernel_source_hash="0" * 16,
            mxdb=__version__,
        )

    def profile(self) -> DeviceProfile:
        from mxdb.tune.space import fake_profile

        return fake_profile(self.device_name)

    def baseline_config(self, shape: MoEShape) -> KernelConfig:
        if self._baseline is not None:
            return self._baseline
        from mxdb.tune.space import flaggems_default

        return flaggems_default(shape)

    def compile(self, shape: MoEShape, configs: Sequence[KernelConfig]) -> list[CompileResult]:
        c = self.counters
        if c.compile_calls == 0 and self.compile_startup_s:
            _time.sleep(self.compile_startup_s)
        c.compile_calls += 1
        c.configs_compiled += len(configs)
        c.compile_seconds += COMPILE_S * math.ceil(len(configs) / COMPILE_WORKERS)
        out = []
        for cfg in configs:
            h = cfg.hash
            c.compiled_hashes.add(h)
            status, error = self._static_failure(shape, cfg)
            if status == "wrong":  # a wrong config compiles fine
                status, error = "ok", None
            out.append(CompileResult(config_hash=h, status=status, error=error, seconds=COMPILE_S))  # type: ignore[arg-type]
        return out

    def time(
        self,
        shape: MoEShape,
        topk_ids: np.ndarray,
        configs: Sequence[KernelConfig],
        *,
        reps: int,
        seed: int,
        method: str = "graph",
        order_seed: int | None = None,
    ) -> list[Timing]:
        if self.sleep_per_time_call_s:
            _time.sleep(self.sleep_per_time_call_s)
        c = self.counters
        c.time_calls += 1
        counts = _counts(topk_ids, shape.experts)
        rng = np.random.default_rng([self.seed & 0xFFFFFFFF, seed & 0xFFFFFFFF, c.time_calls])
        eager_extra = 0.0 if method == "graph" else 6.0 * 5  # host launch overhead per call
        out: list[Timing] = []
        truths: list[float | None] = []
        for cfg in configs:
            status, error = self._static_failure(shape, cfg)
            if status in ("oor", "compile_error", "timeout"):
                truths.append(None)
                out.append(Timing(status=status, samples_us=(), error=error))  # type: ignore[arg-type]
                continue
            truths.append(self.true_us(shape, counts, cfg) + eager_extra)
            out.append(Timing(status="ok", samples_us=(), error=None))
        # interleaved A B C A B C ...: one noise draw per (rep, config)
        draws = rng.lognormal(mean=0.0, sigma=self.noise, size=(reps, len(configs)))
        if self.round_drift:
            draws *= rng.lognormal(mean=0.0, sigma=self.round_drift, size=(reps, 1))
        if self.position_bias:
            orng = np.random.default_rng(order_seed) if order_seed is not None else None
            for r in range(reps):
                order = orng.permutation(len(configs)) if orng is not None else range(len(configs))
                for pos, j in enumerate(order):
                    draws[r, j] *= 1.0 + self.position_bias * pos
        final: list[Timing] = []
        for j, (t, truth) in enumerate(zip(out, truths, strict=True)):
            if truth is None:
                final.append(t)
                continue
            samples = tuple(float(truth * draws[r, j]) for r in range(reps))
            c.configs_timed += 1
            k = self.calls_per_sample
            c.layer_calls += reps * k + OVERHEAD_CALLS
            c.gpu_seconds += (sum(samples) * k + OVERHEAD_CALLS * truth) * 1e-6 + self.overhead_s
            final.append(Timing(status="ok", samples_us=samples, error=None))
        return final

    def check(
        self, shape: MoEShape, topk_ids: np.ndarray, config: KernelConfig, *, seed: int
    ) -> Correctness:
        c = self.counters
        c.check_calls += 1
        t = THRESHOLDS[shape.dtype]
        counts = _counts(topk_ids, shape.experts)
        c.gpu_seconds += (
            3 * self.true_us(shape, counts, config) * 1e-6 + self.overhead_s + 9 * OVERHEAD_S
        )
        status, _ = self._static_failure(shape, config)
        if status == "wrong":
            max_abs, rel = 0.75, 0.4
        else:
            # half an ulp-ish error at outputs around 1, as the real kernels show
            max_abs = t.max_abs * (0.1 + 0.3 * _unit("err", config.hash, seed))
            rel = max_abs / 4.0
        passed = max_abs <= t.max_abs and rel <= t.max_rel
        return Correctness(
            max_abs_err=max_abs,
            rel_err=rel,
            threshold_abs=t.max_abs,
            threshold_rel=t.max_rel,
            passed=passed,
        )

    # -- the model ------------------------------------------------------------------------

    def clock(self) -> float:
        """Simulated seconds spent: GPU time plus compile wall time."""
        return self.counters.gpu_seconds + self.counters.compile_seconds

    def _static_failure(self, shape: MoEShape, cfg: KernelConfig) -> tuple[str, str | None]:
        h = cfg.hash
        for g in (cfg.gemm1, cfg.gemm2):
            need = smem_bytes(g, shape.dtype)
            if need > SMEM_PER_BLOCK:
                return (
                    "oor",
                    f"out of resource: shared memory, required {need}, limit {SMEM_PER_BLOCK}",
                )
        if h in self.compile_errors or any(_is_compile_error(g) for g in (cfg.gemm1, cfg.gemm2)):
            return "compile_error", "triton compile error: register allocation failed (fake)"
        if h in self.timeouts:
            return "timeout", "timed out after 30 s (fake)"
        if h in self.wrong:
            return "wrong", None
        return "ok", None

    def true_us(self, shape: MoEShape, counts: np.ndarray, cfg: KernelConfig) -> float:
        """The noiseless layer time in microseconds for per-expert token counts ``counts``."""
        nbytes = DTYPE_BYTES[shape.dtype]
        if cfg.impl == "fused_slice":
            return self._slice_us(shape, counts, cfg, nbytes)
        a = cfg.align_block
        padded = np.where(counts > 0, -(-counts // a) * a, 0)
        active = int((counts > 0).sum())
        h, i = shape.hidden, shape.intermediate
        t1 = self._gemm_us("g1", shape, cfg.gemm1, padded, active, 2 * i, h, nbytes)
        t2 = self._gemm_us("g2", shape, cfg.gemm2, padded, active, h, i, nbytes)
        slots = float(padded.sum())
        align_us = 2.0 + slots * 2e-4
        act_us = 1.5 + slots * i * nbytes * 3 / BANDWIDTH_B_PER_S * 1e6
        if cfg.impl == "fused_act":
            # one alignment launch instead of five; the activation rides in GEMM1's epilogue
            align_us, act_us = align_us / 4, 0.0
        sum_us = 1.5 + shape.tokens * shape.topk * h * nbytes / BANDWIDTH_B_PER_S * 1e6
        return float(t1 + t2 + align_us + act_us + sum_us)

    def _slice_us(
        self, shape: MoEShape, counts: np.ndarray, cfg: KernelConfig, nbytes: int
    ) -> float:
        """``fused_slice``: one launch streaming each active expert's weights once per tile of
        slots, atomic float32 adds of every slot's row per slice, and the finishing cast."""
        g = cfg.gemm1
        h, i = shape.hidden, shape.intermediate
        tiles_e = -(-counts // g.block_m)
        slices = -(-i // g.block_n)
        programs = max(1, int(tiles_e.sum()) * slices)
        read = float(tiles_e.sum()) * 3 * i * h * nbytes
        atomics = float(counts.sum()) * h * slices * 4 * 2
        inflight = 2 * g.block_n * g.block_k * nbytes * (g.num_stages - 1)
        bw_eff = 0.95 * (1 - math.exp(-inflight / (12 * 1024)))
        conc = min(1.0, programs / (SMS * 2.0))
        mem_us = (read + atomics) / (BANDWIDTH_B_PER_S * bw_eff * max(conc, 0.05)) * 1e6
        # every tile multiplies block_m rows, whatever its expert's count
        flops = 2.0 * float(tiles_e.sum()) * g.block_m * 3 * i * h
        comp_us = flops / (PEAK_FLOPS * 0.5) * 1e6
        quirk = 1.0 + 0.03 * (
            _unit("slice", shape.family, shape.dtype, cfg.short(), self.seed) - 0.5
        )
        naive = shape.tokens * shape.topk * 4 <= shape.experts
        align_us = 0.0 if naive else 0.5 + float(counts.sum()) * 5e-5
        return float((max(mem_us, comp_us) + 2.0) * quirk + align_us + 1.5)

    def _gemm_us(
        self,
        tag: str,
        shape: MoEShape,
        g: GemmConfig,
        padded: np.ndarray,
        active: int,
        n: int,
        k: int,
        nbytes: int,
    ) -> float:
        m_tiles_e = padded // g.block_m
        m_tiles = int(m_tiles_e.sum())
        n_tiles = -(-n // g.block_n)
        tiles = max(1, m_tiles * n_tiles)
        # occupancy: shared memory, warps, registers (fp32 accumulators per thread)
        acc_regs = g.block_m * g.block_n / (g.num_warps * 32)
        regs_per_thread = min(255.0, 40 + acc_regs + (g.block_k / 16) * 4)
        by_regs = REGS_PER_SM // int(regs_per_thread * g.num_warps * 32)
        by_smem = SMEM_PER_SM // max(1, smem_bytes(g, shape.dtype))
        occ = max(1, min(by_smem, MAX_WARPS_PER_SM // g.num_warps, by_regs, 8))
        spill = 1.0 + max(0.0, acc_regs - 128) / 128 * 0.6
        slots = SMS * occ
        waves = math.ceil(tiles / slots)
        util = tiles / (waves * slots)
        # weight traffic: each extra M-tile of an expert re-reads its weights, mostly from L2;
        # a larger group_m improves that reuse
        reuse = 0.25 / (1.0 + math.log2(g.group_m) / 3)
        extra_tiles = float(np.maximum(m_tiles_e - 1, 0).sum())
        weight_bytes = active * n * k * nbytes
        read_bytes = weight_bytes + extra_tiles * n * k * nbytes * reuse
        read_bytes += float(padded.sum()) * k * nbytes * n_tiles / max(1, n // 1024 + 1)
        # bandwidth achieved: bytes in flight per SM and concurrent tiles
        inflight = g.block_n * g.block_k * nbytes * (g.num_stages - 1) * min(occ, tiles / SMS + 1)
        bw_eff = 0.92 * (1 - math.exp(-inflight / (12 * 1024)))
        conc = min(1.0, tiles / (SMS * 1.5))
        mem_us = read_bytes / (BANDWIDTH_B_PER_S * bw_eff * max(conc, 0.05)) * 1e6
        # compute on padded slots; small tiles and too many warps per tile are inefficient
        flops = 2.0 * float(padded.sum()) * n * k
        tile_eff = min(1.0, math.sqrt(g.block_m * g.block_n / (128 * 128)))
        warp_eff = 1.0 if acc_regs >= 8 else 0.85
        comp_us = flops / (PEAK_FLOPS * tile_eff * warp_eff * max(util, 0.05)) * 1e6
        k_steps = -(-k // g.block_k)
        tile_us = waves * k_steps * 0.004 * (1 + 1 / g.num_stages)
        quirk = 1.0 + 0.03 * (_unit(tag, shape.family, shape.dtype, g.short(), self.seed) - 0.5)
        return (max(mem_us, comp_us) * spill + tile_us + 2.0) * quirk


def _counts(topk_ids: np.ndarray, experts: int) -> np.ndarray:
    ids = np.asarray(topk_ids).reshape(-1).astype(np.int64)
    return np.bincount(ids, minlength=experts)[:experts]
