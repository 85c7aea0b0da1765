"""What a measuring device returns: compile outcomes, raw timing samples, correctness.

The ground floor shared by the tuner (``mxdb.tune``) and the measuring devices that implement its
protocols (``mxdb.kernels`` on a GPU, ``mxdb.tune.fake`` on a CPU).  Failures (out of resources,
compile errors, timeouts, wrong results) are results, never exceptions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

CompileStatus = Literal["ok", "oor", "compile_error", "timeout"]
TimingStatus = Literal["ok", "oor", "compile_error", "timeout", "wrong"]


@dataclass(frozen=True, slots=True)
class CompileResult:
    """The outcome of compiling one config for one shape."""

    config_hash: str
    status: CompileStatus
    error: str | None
    seconds: float


@dataclass(frozen=True, slots=True)
class Timing:
    """Raw timing samples of one config (microseconds per layer call), or why there are none."""

    status: TimingStatus
    samples_us: tuple[float, ...]
    error: str | None


@dataclass(frozen=True, slots=True)
class Correctness:
    """A whole-layer result compared with the float32 reference."""

    max_abs_err: float
    rel_err: float
    threshold_abs: float
    threshold_rel: float
    passed: bool
