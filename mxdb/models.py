"""Boundary models (pydantic v2): what crosses files, the CLI and store rows.

Hot-path keys are not here: see ``mxdb.shapes`` and ``mxdb.decision``.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mxdb.hashing import canonical_hash

#: Environment fingerprint components, in a fixed order (DESIGN section 6).
FINGERPRINT_COMPONENTS: tuple[str, ...] = (
    "vendor",
    "device_name",
    "arch",
    "sm_count",
    "smem_per_block",
    "warp_size",
    "driver",
    "toolkit",
    "torch",
    "triton",
    "flag_gems",
    "kernel_source_hash",
    "mxdb",
)

#: Routing classes, coarse and stable buckets of routing features.
ROUTING_CLASSES: tuple[str, ...] = ("uniform", "skewed", "hot", "sparse")

#: Which routing classes are adjacent (may share configs at lower confidence).
ADJACENT_CLASSES: dict[str, frozenset[str]] = {
    "uniform": frozenset({"skewed"}),
    "skewed": frozenset({"uniform", "hot", "sparse"}),
    "hot": frozenset({"skewed", "sparse"}),
    "sparse": frozenset({"skewed", "hot"}),
}

#: verified: correct and faster than FlagGems' own choice beyond the noise band (dispatched);
#: baseline: measured at this key, and nothing beat FlagGems' own choice beyond the noise band
#: (the dispatcher answers with FlagGems' choice there rather than a neighbour's config);
#: parity: a peer table's row (vLLM's) that nothing beat, measured slower than FlagGems' choice
#: on none of the point's routing instances and faster pooled over them (dispatched at its own
#: key; ``mxdb.pointverdict`` rule 2); imported: a peer table's config (a search seed, never
#: dispatched); stale: its environment changed (kept for the record); rejected: withdrawn.
EntryStatus = Literal["verified", "baseline", "parity", "imported", "stale", "rejected"]
#: The statuses of a tuner's decisions still in force: what the dispatcher reads, exports
#: carry, drift judges and a later measurement may reject.
DECIDED_STATUSES: tuple[str, ...] = ("verified", "baseline", "parity")
#: The source of a tuner's best single-config record: status ``imported`` (never dispatched),
#: kept beside a verified winner that vLLM's and FlagGems' tables cannot express
#: (``mxdb.tune.verify.single_record``); the table exports read it.
SINGLE_SOURCE = "tune-single"
MeasurementStatus = Literal["ok", "oor", "compile_error", "wrong", "timeout", "slower"]
MEASUREMENT_STATUSES: tuple[str, ...] = ("ok", "oor", "compile_error", "wrong", "timeout", "slower")


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Fingerprint(BaseModel):
    """The environment a measurement was taken in; ``None`` marks a component that is absent."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    vendor: str | None = None
    device_name: str | None = None
    arch: str | None = None
    sm_count: int | None = None
    smem_per_block: int | None = None
    warp_size: int | None = None
    driver: str | None = None
    toolkit: str | None = None
    torch: str | None = None
    triton: str | None = None
    flag_gems: str | None = None
    kernel_source_hash: str | None = None
    mxdb: str | None = None

    def components(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in FINGERPRINT_COMPONENTS}

    @property
    def hash(self) -> str:
        """SHA-256 of the canonical JSON of all components (hex, 16 digits): stable across runs."""
        return canonical_hash(self.components())

    def absent(self) -> list[str]:
        return [k for k, v in self.components().items() if v is None]


class Entry(BaseModel):
    """A stored config for one op key: what the dispatcher may answer with."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: int | None = None
    op: str = "fused_moe"
    dtype: str
    family: str = Field(
        description="the op's shape without its token count, e.g. E8-H4096-I14336-k2"
    )
    dims: dict[str, int] = Field(description="the op's dimensions, token count included")
    tokens: int = Field(ge=1)
    routing_class: str = "uniform"
    config: dict[str, Any]
    config_hash: str
    fingerprint_hash: str | None = None
    device_name: str | None = None
    status: EntryStatus
    source: str = Field(description="tune, vllm, flaggems or mxdb-import")
    speedup: float | None = None
    noise_band: float | None = None
    median_us: float | None = None
    baseline_us: float | None = None
    evidence: str | None = None
    stale_reason: str | None = None
    confidence: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="the measured fraction of held-out routing instances this config won",
    )
    validation: list[dict[str, Any]] | None = Field(
        default=None,
        description="held-out comparisons behind the entry: routing instances of its class and "
        "neighbouring token counts, each with its verdict (mxdb.verdict)",
    )
    #: Kept by the store only: not serialized, so the store export (``mxdb.store-export``
    #: 1.2, which holds entries) is unchanged.  A superseding tune of the key takes the row.
    job: str | None = Field(
        default=None, exclude=True, description="the tuning job that wrote (or last decided) it"
    )
    created_at: datetime = Field(default_factory=utcnow)


class Measurement(BaseModel):
    """One timed (or failed) candidate: failures are results too."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: int | None = None
    run_id: str
    op: str = "fused_moe"
    dtype: str
    family: str
    dims: dict[str, int]
    tokens: int
    routing_class: str
    trace_hash: str | None = None
    seed: int | None = None
    config: dict[str, Any]
    config_hash: str
    role: Literal["candidate", "baseline", "control", "peer"] = "candidate"
    fidelity: str = Field(
        default="replay", description="proxy, compile, synthetic, replay or layer"
    )
    status: MeasurementStatus
    error: str | None = None
    samples_us: list[float] = Field(default_factory=list)
    median_us: float | None = None
    p90_us: float | None = None
    max_abs_err: float | None = None
    rel_err: float | None = None
    timing_method: str | None = None
    fingerprint_hash: str | None = None
    point: str | None = Field(default=None, description="the tuning point it belongs to")
    comparison: str | None = Field(
        default=None,
        description="the interleaved comparison it was timed in: replay, heldout-N or tokens-M",
    )
    margin: float | None = Field(
        default=None, ge=0, description="the verdict margin the comparison was judged with"
    )
    order_seed: int | None = Field(
        default=None, description="seed of the comparison's randomized order per round"
    )
    job: str | None = Field(default=None, description="the tuning job that measured it")
    decision_rule: int | None = Field(
        default=None, ge=1, description="the mxdb.pointverdict rule its point was decided by"
    )
    created_at: datetime = Field(default_factory=utcnow)
