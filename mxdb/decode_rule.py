"""The decode ops' decision rule and its data: the case, each timed candidate, the result.

The ground floor shared by the decode tuner (:mod:`mxdb.tune.decode`, which measures) and the
decode evidence (:mod:`mxdb.evidence.decode`, whose audit recomputes every decision with
:func:`decide`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from mxdb.errors import UsageError
from mxdb.evidence import stats
from mxdb.models import Entry, Measurement
from mxdb.shapes import OpShape, canonical_dtype
from mxdb.verdict import passes

BASELINE = "torch"
#: The dims each op's shape is keyed by (besides the row count).
OP_DIMS: dict[str, tuple[str, ...]] = {
    "rms_norm": ("n",),
    "add_rms_norm": ("n",),
    "rope": ("hq", "hk", "d"),
    "masked_softmax": ("h", "k"),
    "swiglu": ("n",),
}
#: The routing class decode entries are stored under (the dispatcher's default for None).
ROUTING_CLASS = "uniform"


@dataclass(frozen=True)
class DecodeCase:
    """One op call to tune: op name, its dims (see ``OP_DIMS``), row count and dtype."""

    op: str
    dims: Mapping[str, int]
    tokens: int
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        want = OP_DIMS.get(self.op)
        if want is None:
            raise UsageError(f"decode op {self.op!r} unknown; use one of {', '.join(OP_DIMS)}")
        if set(self.dims) != set(want):
            raise UsageError(
                f"{self.op} needs dims {', '.join(want)}; got {', '.join(sorted(self.dims))}"
            )
        object.__setattr__(self, "dims", dict(self.dims))
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))

    def shape(self) -> OpShape:
        return OpShape(self.op, dict(self.dims), self.tokens, self.dtype)


@dataclass(frozen=True)
class Candidate:
    """One timed implementation of one case (the raw material of the decision)."""

    impl: str
    role: str  # baseline | control | candidate
    status: str  # ok | wrong | timeout | compile_error | slower
    samples_us: tuple[float, ...]
    max_abs_err: float | None
    rel_err: float | None
    error: str | None = None


@dataclass(frozen=True)
class DecodeResult:
    """The decision for one case, with every candidate's raw figures."""

    case: DecodeCase
    winner: str
    speedup: float
    noise_band: float | None
    winner_median_us: float
    baseline_median_us: float
    candidates: tuple[Candidate, ...]
    reason: str
    entry: Entry | None = None
    measurements: tuple[Measurement, ...] = field(default=())


def decide(dtype: str, candidates: Sequence[Candidate]) -> tuple[str, float, float | None, str]:
    """The rule: ``(winner, speedup, noise band, reason)`` from raw candidates (audit uses it)."""
    base = next(c for c in candidates if c.role == "baseline")
    ctl = [c for c in candidates if c.role == "control"]
    base_med = stats.median(base.samples_us)
    band = None
    if ctl and ctl[0].samples_us:
        band = stats.pair_noise(base_med, stats.median(ctl[0].samples_us))
    best: tuple[float, str] | None = None
    for c in candidates:
        if c.role != "candidate" or not c.samples_us:
            continue
        if not passes(dtype, c.max_abs_err, c.rel_err):
            continue
        sp = stats.speedup(base_med, stats.median(c.samples_us))
        if best is None or sp > best[0]:
            best = (sp, c.impl)
    if best is None:
        return BASELINE, 1.0, band, "no correct candidate other than torch"
    if band is None:
        return BASELINE, 1.0, band, "no control pair: the noise band is unknown"
    if best[0] - 1.0 > band:
        return best[1], best[0], band, f"{best[1]} {best[0]:.4f}x exceeds the noise band {band:.4f}"
    return BASELINE, 1.0, band, f"best {best[1]} {best[0]:.4f}x is within the noise band {band:.4f}"
