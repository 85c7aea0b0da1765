"""The replay backend: a recorded sweep served as a tuning backend (develop the search on a CPU).

A tuning-cost bundle (``benchmarks/bench_tuning.py``) records, per point, every grid config
timed as GEMM1 with GEMM2 fixed at FlagGems' choice, and as GEMM2 with GEMM1 fixed.  The
layer's GEMMs run one after the other, so their times add; ``SweepReplay`` builds the layer
time of any (GEMM1, GEMM2, alignment block) from the two sweeps:

    T(g1, g2, a) = S1[g1] + S2[g2] - T_base
                   + padding terms for the alignment block a

where ``S1``/``S2`` are the sweeps' medians and ``T_base`` FlagGems' choice (timed in both).
The alignment block pads every expert's token count to a multiple of ``a``; a GEMM with
BLOCK_SIZE_M ``bm`` then runs ``ceil(count / a) * a / bm`` M-tiles per expert, and every extra
M-tile re-reads that expert's weights.  The sweeps time each config at ``a = its own bm`` with
the other GEMM at FlagGems' bm=16, so the terms move every GEMM to the common block: KAPPA
(microseconds per extra M-tile of one GEMM) was fitted to the recorded joint configs with
a > 16 (M=64 at a=64 and M=256 at a=32 agree within 7%); at a = 16 the additive model is
within 0.5% of the recorded final timings.

Noise resembles the recorded replicates: a per-config factor for this "process" (the same
config measured in another run moved by ~0.4%, at times ~1.5-2%), a per-call factor and
per-sample noise (~0.2%, rare outliers); synthetic routing adds a per-config factor.
Configs the sweeps could not time answer with what the sweep recorded (``compile_error``)
or what the resource proxy says (``oor``).

GPU time (``counters.gpu_seconds``) follows how an H200 spent it in the recorded sweeps
(``time_call_wall_s``, fitted per call): per time() call ~24 ms; per config timed ~6.7 ms of
pipeline set-up, correctness pre-check and graph capture plus ~19 layer calls (warm-up,
capture, first replays) and 8 calls per sample; a new weight seed ~40 ms; a new routing ~20 ms;
the first call of a process ~5 s, of each new point ~0.7 s.  Compile time is host time and is not counted.

``benchmarks/sweep_replay.py`` runs the tuning benchmark on it.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mxdb.configs import GemmConfig, KernelConfig
from mxdb.models import Fingerprint
from mxdb.results import CompileResult, Correctness, Timing
from mxdb.routing import expert_counts
from mxdb.shapes import MoEShape
from mxdb.tune.space import SearchSpace
from mxdb.verdict import THRESHOLDS

#: Extra-M-tile cost (us) of GEMM1 and GEMM2 (their expert weights are 2I x H and H x I).
KAPPA = {"gemm1": 0.53, "gemm2": 0.27}
#: GPU-time model (seconds), fitted to the recorded sweeps' time_call_wall_s.
CALL_S = 0.024
CONFIG_S = 0.0067
EXTRA_CALLS = 19
NEW_WEIGHTS_S = 0.04
NEW_ROUTING_S = 0.02
#: the first call of a process (CUDA graphs, launchers, allocator: ~5 s on a fresh H200 host) and
#: the first call of each new point (~0.7 s more than its later calls in the recorded runs)
FIRST_CALL_S = 5.0
NEW_POINT_S = 0.7
CHECK_S = 0.001


def _unit(*parts: object) -> float:
    digest = hashlib.sha256("|".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _gauss(*parts: object) -> float:
    """A deterministic standard normal draw from ``parts``."""
    u1 = max(_unit("a", *parts), 1e-12)
    u2 = _unit("b", *parts)
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2 * math.pi * u2)


@dataclass
class ReplayCounters:
    time_calls: int = 0
    configs_timed: int = 0
    check_calls: int = 0
    gpu_seconds: float = 0.0
    compile_seconds: float = 0.0
    compiled: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Noise:
    """Multiplicative noise (log-normal sigmas) of a replayed measurement."""

    process: float = 0.004  # per config, for the whole backend instance
    process_tail: float = 0.015  # ... for a share ``tail_p`` of the configs
    tail_p: float = 0.08
    call: float = 0.0015  # per config and time() call
    sample: float = 0.002  # per sample
    outlier_p: float = 0.02  # a sample 1-3% slow
    synthetic: float = 0.006  # per config, on routing other than the sweeps'


class SweepTable:
    """The two sweeps of one recorded point."""

    def __init__(self, gemm1: dict[str, Any], gemm2: dict[str, Any]) -> None:
        self.s1: dict[GemmConfig, float] = {}
        self.s2: dict[GemmConfig, float] = {}
        base1 = base2 = None
        for which, doc, table in (("gemm1", gemm1, self.s1), ("gemm2", gemm2, self.s2)):
            for r in doc["timed"]:
                c = KernelConfig.parse(r["config"])
                if r["status"] != "ok" or not r["samples_us"]:
                    continue
                g = c.gemm1 if which == "gemm1" else c.gemm2
                table[g] = statistics.median(r["samples_us"])
                if which == "gemm1":
                    base2 = c.gemm2
                else:
                    base1 = c.gemm1
        assert base1 is not None and base2 is not None
        self.base = KernelConfig(gemm1=base1, gemm2=base2, align_block=max(16, base1.block_m))
        self.t_base = 0.5 * (self.s1[base1] + self.s2[base2])

    @classmethod
    def load(cls, bundle: Path, point: str) -> SweepTable:
        return cls(
            json.loads((bundle / "sweeps" / f"{point}-gemm1.json").read_text()),
            json.loads((bundle / "sweeps" / f"{point}-gemm2.json").read_text()),
        )


def _mtiles(counts: np.ndarray, align: int, bm: int) -> float:
    c = counts[counts > 0]
    return float((-(-c // align) * align).sum() / bm)


class SweepReplay:
    """The tune Backend protocol, answered from a :class:`SweepTable` (module docstring)."""

    name = "sweep-replay"
    calls_per_sample = 8

    def __init__(
        self,
        table: SweepTable,
        shape: MoEShape,
        replay_ids: np.ndarray,
        *,
        seed: int = 0,
        noise: Noise | None = None,
        first_call_s: float = FIRST_CALL_S,
    ) -> None:
        self.table = table
        self.shape = shape
        self.replay_hash = hashlib.sha256(np.ascontiguousarray(replay_ids).tobytes()).hexdigest()
        self.seed = seed
        self.noise = noise or Noise()
        self.first_call_s = first_call_s
        self.counters = ReplayCounters()
        self._space = SearchSpace(shape, self.profile())
        self._weights_seed: int | None = None
        self._routings: set[tuple[str, int]] = set()
        self._new_point = True

    # -- protocol ----------------------------------------------------------------------------
    def fingerprint(self) -> Fingerprint:
        from mxdb.fingerprint import H200
        from mxdb.version import __version__

        # the recorded H200's device facts; the software is the replay's, not a GPU stack's
        return Fingerprint(
            **{
                **H200,
                "vendor": "replay",
                "device_name": "NVIDIA H200 (recorded sweeps)",
                "driver": "replay",
                "toolkit": "replay",
                "torch": None,
                "triton": None,
                "flag_gems": None,
                "kernel_source_hash": "0" * 16,
                "mxdb": __version__,
            }
        )

    def profile(self) -> Any:
        from mxdb.profiles import get_profile

        return get_profile("h200")

    def baseline_config(self, shape: MoEShape) -> KernelConfig:
        return self.table.base

    def warm_up(self) -> None:
        self.first_call_s = 0.0  # the process start-up is paid outside the meter

    def compile(self, shape: MoEShape, configs: Sequence[KernelConfig]) -> list[CompileResult]:
        out = []
        for c in configs:
            status, err = self._status(c)
            if status == "ok":
                self.counters.compiled.add(c.hash)
            out.append(CompileResult(c.hash, status, err, 0.0))  # type: ignore[arg-type]
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
        c = self.counters
        c.time_calls += 1
        ids = np.ascontiguousarray(topk_ids)
        rhash = hashlib.sha256(ids.tobytes()).hexdigest()
        gpu = CALL_S + self.first_call_s + (NEW_POINT_S if self._new_point else 0.0)
        self.first_call_s = 0.0
        self._new_point = False
        if seed != self._weights_seed:
            self._weights_seed = seed
            gpu += NEW_WEIGHTS_S
        if (rhash, seed) not in self._routings:
            self._routings.add((rhash, seed))
            gpu += NEW_ROUTING_S
        counts = expert_counts(ids, shape.experts)
        rng = np.random.default_rng([self.seed & 0xFFFFFFFF, seed & 0xFFFFFFFF, c.time_calls])
        out = []
        nz = self.noise
        for cfg in configs:
            status, err = self._status(cfg)
            if status != "ok":
                gpu += CONFIG_S
                out.append(Timing(status, (), err))  # type: ignore[arg-type]
                continue
            truth = self.true_us(cfg, counts, rhash)
            base = truth * math.exp(nz.call * rng.standard_normal())
            s = base * np.exp(nz.sample * rng.standard_normal(reps))
            slow = rng.random(reps) < nz.outlier_p
            s = np.where(slow, s * (1.01 + 0.02 * rng.random(reps)), s)
            samples = tuple(float(x) for x in s)
            c.configs_timed += 1
            gpu += CONFIG_S + (EXTRA_CALLS * truth + sum(samples) * self.calls_per_sample) * 1e-6
            out.append(Timing("ok", samples, None))
        c.gpu_seconds += gpu
        return out

    def check(
        self, shape: MoEShape, topk_ids: np.ndarray, config: KernelConfig, *, seed: int
    ) -> Correctness:
        self.counters.check_calls += 1
        t = THRESHOLDS[shape.dtype]
        status, _ = self._status(config)
        counts = expert_counts(np.asarray(topk_ids), shape.experts)
        if status == "ok":
            self.counters.gpu_seconds += CHECK_S + 3 * self.true_us(config, counts, "") * 1e-6
        err = t.max_abs * 0.1
        return Correctness(err, err / 4, t.max_abs, t.max_rel, status == "ok")

    # -- the model ---------------------------------------------------------------------------
    def _status(self, cfg: KernelConfig) -> tuple[str, str | None]:
        reason = self._space.verdict(cfg)
        if reason is not None:
            return "oor", reason
        if cfg.gemm1 not in self.table.s1 or cfg.gemm2 not in self.table.s2:
            return "compile_error", "not timed in the recorded sweep (compile error there)"
        return "ok", None

    def model_us(self, cfg: KernelConfig, counts: np.ndarray) -> float:
        """The noiseless layer time from the sweeps (module docstring)."""
        tb = self.table
        g1, g2, a = cfg.gemm1, cfg.gemm2, cfg.align_block
        b1, b2 = tb.base.gemm1.block_m, tb.base.gemm2.block_m
        k1, k2 = KAPPA["gemm1"], KAPPA["gemm2"]

        def extra(k: float, bm: int, at: int, frm: int) -> float:
            return k * (_mtiles(counts, at, bm) - _mtiles(counts, frm, bm))

        m1, m2 = max(g1.block_m, b2), max(g2.block_m, b1)  # the sweeps' alignment blocks
        t = tb.s1[g1] + tb.s2[g2] - tb.t_base
        # move each sweep's fixed (FlagGems) GEMM back to bm=16 alignment ...
        t -= extra(k2, b2, m1, max(b2, 16)) + extra(k1, b1, m2, max(b1, 16))
        # ... and each tuned GEMM from its sweep's block to the layer's
        t += extra(k1, g1.block_m, a, m1) + extra(k2, g2.block_m, a, m2)
        return t

    def true_us(self, cfg: KernelConfig, counts: np.ndarray, routing_hash: str) -> float:
        nz = self.noise
        t = self.model_us(cfg, counts)
        h = cfg.hash
        tail = _unit("tail", h, self.seed) < nz.tail_p
        t *= math.exp((nz.process_tail if tail else nz.process) * _gauss("proc", h, self.seed))
        if routing_hash and routing_hash != self.replay_hash:
            t *= math.exp(nz.synthetic * _gauss("syn", h, routing_hash))
        return t
