"""The evidence bundle's file formats, as pydantic models (the JSON Schemas are generated here).

A bundle is a directory::

    manifest.json             mxdb.manifest   SHA-256 of every other file, and their digest
    signatures/<key_id>.sig   mxdb.signature  optional Ed25519 signatures (outside the manifest)
    fingerprint.json          mxdb.fingerprint  the environment every run was measured in
    traces/<trace_hash>.json  mxdb.trace      top-k expert ids replayed by the runs
    runs/<run_id>.json        mxdb.run        one measured (or failed) candidate, raw samples
    summary.json              mxdb.summary    the milestone summary, derived from the runs
    store_export.json         mxdb.store-export  optional: the verified entries of this tune
    report/report.json        mxdb.report     optional: the report's figures

Every document carries ``schema`` (its name) and ``schema_version``.  The auditor reads these
files with ``json`` and ``jsonschema`` only; the models are for writers and schema generation.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mxdb.models import Fingerprint

#: The version of every evidence document this mxdb writes and understands.
SCHEMA_VERSION = "1.0"
#: The schema versions the auditor understands, per document name.
KNOWN_VERSIONS: dict[str, tuple[str, ...]] = {
    "mxdb.manifest": ("1.0",),
    "mxdb.fingerprint": ("1.0", "1.1"),
    "mxdb.trace": ("1.0",),
    "mxdb.run": ("1.0", "1.1", "1.2", "1.3"),
    "mxdb.summary": ("1.0", "1.1"),
    "mxdb.report": ("1.0",),
    "mxdb.signature": ("1.0",),
    "mxdb.store-export": ("1.0", "1.1", "1.2", "1.3"),
    "mxdb.compile-survey": ("1.0", "1.1"),
    "mxdb.decode": ("1.0",),
    "mxdb.peers": ("1.0", "1.1", "1.2", "1.3", "1.4", "1.5"),
    "mxdb.lean-layer": ("1.0",),
    "mxdb.self-healing": ("1.0",),
    "mxdb.serving": ("1.0", "1.1"),
    "mxdb.stages": ("1.0", "1.1"),
}

RunRole = Literal["baseline", "candidate", "control", "peer"]
RunStatus = Literal["ok", "oor", "compile_error", "wrong", "timeout", "slower"]
TimingMethod = Literal["cuda_graph_replay", "eager", "events"]
#: Statuses that are failures (listed in a summary, never hidden).
FAILURE_STATUSES: tuple[str, ...] = ("oor", "compile_error", "wrong", "timeout")

_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_HEX16 = r"^[0-9a-f]{16}$"
_HEX64 = r"^[0-9a-f]{64}$"

# serialization-mode schemas mark defaulted fields required: every written file has them all
_FROZEN = ConfigDict(
    frozen=True,
    extra="forbid",
    populate_by_name=True,
    json_schema_serialization_defaults_required=True,
)


class _Doc(BaseModel):
    model_config = _FROZEN

    def to_json_dict(self) -> dict[str, Any]:
        """The document as written to disk (aliases, JSON types)."""
        return self.model_dump(mode="json", by_alias=True)


class Manifest(_Doc):
    """``manifest.json``: the SHA-256 of every file of the bundle, written last."""

    schema_name: Literal["mxdb.manifest"] = Field(default="mxdb.manifest", alias="schema")
    schema_version: Literal["1.0"] = "1.0"
    bundle_id: str = Field(pattern=_ID)
    milestone: str = Field(min_length=1)
    created_at: str = Field(description="ISO 8601 UTC time the bundle was finished")
    files: dict[str, str] = Field(
        description="relative POSIX path -> SHA-256 (hex) of every file except manifest.json "
        "and signatures/"
    )
    digest: str = Field(
        pattern=_HEX64,
        description="SHA-256 of the lines '<sha256>  <path>\\n' sorted by path (sha256sum format)",
    )


class SignatureDoc(_Doc):
    """``signatures/<key_id>.sig``: an Ed25519 signature of the manifest file's SHA-256."""

    schema_name: Literal["mxdb.signature"] = Field(default="mxdb.signature", alias="schema")
    schema_version: Literal["1.0"] = "1.0"
    algorithm: Literal["ed25519"] = "ed25519"
    key_id: str = Field(pattern=_HEX16, description="SHA-256 of the raw public key, 16 hex digits")
    public_key: str = Field(description="raw 32-byte public key, base64")
    manifest_sha256: str = Field(pattern=_HEX64)
    signature: str = Field(description="base64 of the 64-byte Ed25519 signature")


def optional_fields(*names: str) -> ConfigDict:
    """The evidence config, with ``names`` optional in the JSON Schema (fields a later schema
    version added, absent from documents of the earlier ones)."""

    def extra(schema: dict[str, Any]) -> None:
        schema["required"] = [r for r in schema.get("required", []) if r not in names]

    return ConfigDict(**{**_FROZEN, "json_schema_extra": extra})


class FingerprintDoc(_Doc):
    """``fingerprint.json``: the environment of the milestone.

    1.1 added ``data``: recorded facts of the environment that are not part of the
    fingerprint's hash (``mxdb.fingerprint.FINGERPRINT_DATA``, e.g. the hash of the config
    table FlagGems reads).
    """

    model_config = optional_fields("data")  # 1.0 documents have no ``data``

    schema_name: Literal["mxdb.fingerprint"] = Field(default="mxdb.fingerprint", alias="schema")
    schema_version: Literal["1.0", "1.1"] = "1.1"
    fingerprint: Fingerprint
    hash: str = Field(pattern=_HEX16)
    data: dict[str, str] = Field(
        default_factory=dict,
        description="recorded facts outside the hash, e.g. flaggems_moe_table",
    )


class TraceGenerator(_Doc):
    """How a trace was produced (``kind`` e.g. captured, uniform, zipf; its seed and parameters)."""

    kind: str = Field(min_length=1)
    seed: int | None = None
    params: dict[str, Any] = Field(default_factory=dict)


class TraceDoc(_Doc):
    """``traces/<trace_hash>.json``: the top-k expert ids ``[tokens][topk]`` of one batch."""

    schema_name: Literal["mxdb.trace"] = Field(default="mxdb.trace", alias="schema")
    schema_version: Literal["1.0"] = "1.0"
    experts: int = Field(ge=1)
    tokens: int = Field(ge=1)
    topk: int = Field(ge=1)
    ids: list[list[int]]
    trace_hash: str = Field(
        pattern=_HEX16, description="SHA-256 of canonical JSON {experts, ids}, 16 hex digits"
    )
    generator: TraceGenerator


class ShapeDoc(_Doc):
    """A fused-MoE shape, as ``MoEShape.to_dict()`` writes it."""

    op: Literal["fused_moe"] = "fused_moe"
    dtype: Literal["fp16", "bf16", "fp32"]
    experts: int = Field(ge=1)
    hidden: int = Field(ge=1)
    intermediate: int = Field(ge=1)
    topk: int = Field(ge=1)
    tokens: int = Field(ge=1)


class Correctness(_Doc):
    """A run's errors against the float32 reference, the thresholds applied and the verdict."""

    max_abs_err: float | None
    rel_err: float | None
    threshold_abs: float
    threshold_rel: float
    passed: bool


class Timing(_Doc):
    """Raw timing samples (one per replicate, microseconds) and the figures derived from them."""

    method: TimingMethod
    samples_us: list[float] = Field(min_length=1)
    median_us: float
    p90_us: float
    warmup: int = Field(ge=0)
    replicates: int = Field(ge=1, description="number of samples (one per interleaved replicate)")


class RunRecord(_Doc):
    """``runs/<run_id>.json``: one measured or failed candidate; failures are results too.

    The version names the point decision rule the bundle's store export was made by
    (``mxdb.pointverdict.RUN_SCHEMA_OF_RULE``): 1.1 rule 1, 1.2 rule 2 (the peer row's parity
    record), 1.3 rule 3 (the replay choice's parity record); same fields.
    """

    schema_name: Literal["mxdb.run"] = Field(default="mxdb.run", alias="schema")
    schema_version: Literal["1.0", "1.1", "1.2", "1.3"] = "1.3"
    run_id: str = Field(pattern=_ID)
    milestone: str = Field(min_length=1)
    op: Literal["fused_moe"] = "fused_moe"
    shape: ShapeDoc
    routing_class: str = Field(min_length=1)
    trace_hash: str | None = Field(default=None, pattern=_HEX16)
    seed: int | None = None
    config: dict[str, Any]
    config_hash: str = Field(pattern=_HEX16)
    role: RunRole
    pair_id: str | None = Field(
        default=None, description="control runs: the id shared by the two runs of an A-vs-A pair"
    )
    fidelity: str = "replay"
    status: RunStatus
    error: str | None = None
    correctness: Correctness | None = None
    timing: Timing | None = None
    eager_timing: Timing | None = Field(
        default=None, description="eager-mode time, reported separately from graph replays"
    )
    fingerprint: Fingerprint
    fingerprint_hash: str = Field(pattern=_HEX16)
    point: str | None = Field(
        default=None,
        description="the tuning point this run belongs to (run schema 1.1); with it, the run's "
        "comparison group is (point, comparison), judged by mxdb.verdict",
    )
    comparison: str | None = Field(
        default=None, description="replay, heldout-N or tokens-M (mxdb.pointverdict)"
    )
    margin: float | None = Field(default=None, ge=0, description="the verdict's margin")
    order_seed: int | None = Field(
        default=None, description="seed of the randomized order of the comparison's rounds"
    )


class GroupSummary(_Doc):
    """One comparison group: a shape (dtype and token count M included) under one routing class."""

    key: str
    op: str
    family: str
    dtype: str
    tokens: int
    routing_class: str
    trace_hashes: list[str]
    baseline_run: str | None
    baseline_median_us: float | None
    candidate_runs: list[str]
    control_pairs: list[list[str]]
    noise_band: float | None
    best_run: str | None
    best_config_hash: str | None
    best_median_us: float | None
    speedup: float | None
    verified: bool
    failures: list[str]
    floor_us: float | None
    floor_fraction: float | None = Field(
        description="memory-bound floor time / the best (else baseline) median"
    )
    speedup_low: float | None = Field(
        default=None, description="lower bound of the speedup's interval (summary 1.1)"
    )
    speedup_high: float | None = Field(
        default=None, description="upper bound of the speedup's interval (summary 1.1)"
    )


class FailureItem(_Doc):
    run_id: str
    status: str
    error: str | None


class Counts(_Doc):
    runs: int
    by_status: dict[str, int]
    by_role: dict[str, int]
    groups: int
    verified_groups: int
    control_pairs: int


class Summary(_Doc):
    """``summary.json``: the milestone summary, every figure derived from the runs' raw samples."""

    schema_name: Literal["mxdb.summary"] = Field(default="mxdb.summary", alias="schema")
    schema_version: Literal["1.0", "1.1"] = "1.0"
    milestone: str
    fingerprint_hash: str
    bandwidth_bytes_per_s: float | None = Field(
        description="device memory bandwidth used for the memory-bound floor (input, not derived)"
    )
    groups: list[GroupSummary]
    geomean_speedup: float | None = Field(description="over groups with a speedup")
    geomean_verified_speedup: float | None = Field(description="over verified groups")
    counts: Counts
    failures: list[FailureItem]
    false_verify: dict[str, Any] | None = Field(
        default=None,
        description="summary 1.1: A/A comparisons of FlagGems' same-config copies that the "
        "verdict rule called faster (mxdb.verdict.false_verify_rate)",
    )


class ReportRow(_Doc):
    key: str
    family: str
    dtype: str
    tokens: int
    routing_class: str
    baseline_median_us: float | None
    best_median_us: float | None
    speedup: float | None
    noise_band: float | None
    speedup_low: float | None = Field(description="speedup / (1 + noise band)")
    verified: bool
    floor_fraction: float | None
    failures: list[str]


class Report(_Doc):
    """``report.json``: the figures of ``mxdb report``, a pure function of the summary."""

    schema_name: Literal["mxdb.report"] = Field(default="mxdb.report", alias="schema")
    schema_version: Literal["1.0"] = "1.0"
    milestone: str
    fingerprint_hash: str
    rows: list[ReportRow]
    geomean_speedup: float | None
    geomean_verified_speedup: float | None
    failures: list[FailureItem]
    counts: Counts
