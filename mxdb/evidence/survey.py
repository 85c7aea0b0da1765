"""Compile surveys: which configs of a tuning grid really fail to compile, and what the proxy says.

A survey bundle is a directory::

    manifest.json     mxdb.manifest         SHA-256 of every other file (written last)
    fingerprint.json  mxdb.fingerprint      the environment the configs were compiled in
    survey.json       mxdb.compile-survey   raw compile results, the full grid, the claims

``survey.json`` holds the raw result of every distinct compilation (status, Triton's error,
shared memory used or required, registers, spills), the grid those compilations cover (each
grid config names the compilation it shares), the resource proxy's verdict on every grid
config (``mxdb.resources.estimate`` under the recorded device profile and Triton release) and
the claimed figures.  The auditor (``mxdb.audit.survey``) re-runs the proxy on CPU and
recomputes every figure with :func:`survey_figures`.

``build_survey`` turns the output of ``benchmarks/gpu_survey.py`` (its ``survey.json``) into
the document; ``write_survey_bundle`` writes the bundle atomically.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import Field, ValidationError

from mxdb.configs import GemmConfig
from mxdb.errors import EvidenceError
from mxdb.evidence.models import _HEX16, _ID, ShapeDoc, _Doc
from mxdb.models import Fingerprint
from mxdb.profiles import DeviceProfile, profile_for_device_name
from mxdb.resources import VLLM_GRID, estimate
from mxdb.results import CompileStatus
from mxdb.shapes import MoEShape

SURVEY_SCHEMA = "mxdb.compile-survey"
SURVEY_VERSION = "1.0"
SURVEY_FILE = "survey.json"
#: The proxy must reject at least this fraction of the configs that fail to compile.
PROXY_THRESHOLD = 0.95
#: The fields that decide a compilation: GROUP_SIZE_M only reorders program ids at run time.
COMPILE_KEY: tuple[str, ...] = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
COMPILE_STATUSES: tuple[str, ...] = get_args(CompileStatus)
#: Failure kinds that are the device's resources running out (what the proxy models).
RESOURCE_FAILURES: tuple[str, ...] = ("oor",)

EXPANSION = (
    "each of the grid's GROUP_SIZE_M values shares the compilation of its (BLOCK_SIZE_M, "
    "BLOCK_SIZE_N, BLOCK_SIZE_K, num_warps, num_stages): GROUP_SIZE_M only reorders the "
    "program ids at run time and leaves the compiled kernel's status, shared memory, registers "
    "and spills unchanged (group_m_control recompiles a sample with other GROUP_SIZE_M values)"
)


class CompileRecord(_Doc):
    """One distinct compilation: its key, what Triton said, and the resources it used."""

    block_m: int = Field(ge=1)
    block_n: int = Field(ge=1)
    block_k: int = Field(ge=1)
    num_warps: int = Field(ge=1)
    num_stages: int = Field(ge=1)
    status: CompileStatus
    error: str | None = Field(description="Triton's error text (failures only)")
    smem_bytes: int | None = Field(
        description="shared memory the compiled kernel uses, or requires when out of resources"
    )
    smem_required: int | None = Field(description="out of resources: the required bytes")
    smem_limit: int | None = Field(description="out of resources: the hardware limit")
    resource: str | None = Field(description="out of resources: which resource")
    n_regs: int | None
    n_spills: int | None
    seconds: float | None = Field(description="compile wall time")


class GroupControl(_Doc):
    """A compilation repeated with another GROUP_SIZE_M, to show the grid's expansion holds."""

    block_m: int = Field(ge=1)
    block_n: int = Field(ge=1)
    block_k: int = Field(ge=1)
    num_warps: int = Field(ge=1)
    num_stages: int = Field(ge=1)
    group_m: int = Field(ge=1)
    status: CompileStatus
    smem_bytes: int | None
    n_regs: int | None
    n_spills: int | None
    same_as_group1: bool = Field(description="status, shared memory, registers, spills equal")


class GridDoc(_Doc):
    """The tuning grid the compilations cover."""

    name: str
    source: str
    axes: dict[str, list[int]]
    size: int = Field(ge=1)
    compile_key: list[str]
    expansion: str


class GridRow(_Doc):
    """One grid config: the compilation it shares, its status and the proxy's verdict."""

    config: dict[str, int]
    compile: int = Field(ge=0, description="index into compiles")
    status: CompileStatus
    proxy_rejects: bool
    proxy_reasons: list[str]
    known_failure: str | None


class KindFigures(_Doc):
    """How many configs of one kind there are and how many of them the proxy rejects."""

    configs: int
    proxy_rejected: int
    proxy_rejected_fraction: float | None


class SurveyClaims(_Doc):
    """The claimed figures, over the whole grid; every one recomputed by the audit."""

    grid_configs: int
    distinct_compiles: int
    by_status: dict[str, int]
    distinct_by_status: dict[str, int]
    failures: int
    proxy_rejected: int
    proxy_rejected_failures: int
    proxy_rejected_failures_fraction: float | None
    proxy_rejected_ok: int = Field(description="configs that compiled yet the proxy rejects")
    by_failure_kind: dict[str, KindFigures]
    resource_failures: KindFigures = Field(description="failures that are out-of-resource ones")
    resource_rules_only: KindFigures = Field(
        description="all failures, counting only rejections by resource rules (no known "
        "compiler-failure rule)"
    )
    threshold: float
    meets_threshold: bool = Field(
        description="rejected fraction of failures >= threshold and no compiled config rejected"
    )


class SurveyRun(_Doc):
    """How the compilations were run."""

    workers: int | None
    wall_s: float | None
    compile_seconds_sum: float | None
    group_m_control_wall_s: float | None


class CompileSurvey(_Doc):
    """``survey.json``: a compile survey of a tuning grid on one device, with the proxy's verdicts."""

    schema_name: Literal["mxdb.compile-survey"] = Field(
        default="mxdb.compile-survey", alias="schema"
    )
    #: 1.1: the device profile's shared-memory rule may be ``mctriton``
    schema_version: Literal["1.0", "1.1"] = "1.1"
    milestone: str = Field(pattern=_ID)
    what: str
    kernel: str
    shape: ShapeDoc
    gemm_index: int = Field(ge=1, le=2)
    gemm_n: int = Field(ge=1)
    gemm_k: int = Field(ge=1)
    fingerprint: Fingerprint
    fingerprint_hash: str = Field(pattern=_HEX16)
    profile: DeviceProfile
    proxy: str
    run: SurveyRun
    grid: GridDoc
    compiles: list[CompileRecord]
    group_m_control: list[GroupControl]
    rows: list[GridRow]
    claims: SurveyClaims
    notes: list[str]


# -- figures -------------------------------------------------------------------------------


def key_of(doc: Mapping[str, Any]) -> tuple[int, ...]:
    """The compile key (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of a record or config."""
    return tuple(int(doc[k]) for k in COMPILE_KEY)


def _fraction(num: int, den: int) -> float | None:
    return num / den if den else None


def _kind(rows: Sequence[Mapping[str, Any]], rejected: Sequence[bool]) -> dict[str, Any]:
    n = len(rows)
    r = sum(1 for x in rejected if x)
    return {"configs": n, "proxy_rejected": r, "proxy_rejected_fraction": _fraction(r, n)}


def survey_figures(
    rows: Sequence[Mapping[str, Any]], compiles: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """The claims of a survey from its grid rows (status, proxy verdict) and its compilations."""
    by_status = Counter(str(r["status"]) for r in rows)
    fails = [r for r in rows if r["status"] != "ok"]
    kinds: dict[str, Any] = {}
    for kind in sorted({str(r["status"]) for r in fails}):
        sel = [r for r in fails if r["status"] == kind]
        kinds[kind] = _kind(sel, [bool(r["proxy_rejects"]) for r in sel])
    resource = [r for r in fails if r["status"] in RESOURCE_FAILURES]
    rejected_fail = sum(1 for r in fails if r["proxy_rejects"])
    rejected_ok = sum(1 for r in rows if r["status"] == "ok" and r["proxy_rejects"])
    fraction = _fraction(rejected_fail, len(fails))

    def resource_rule_rejects(r: Mapping[str, Any]) -> bool:
        # a known compiler-failure rule adds exactly one reason
        return len(r["proxy_reasons"]) > (1 if r.get("known_failure") else 0)

    return {
        "grid_configs": len(rows),
        "distinct_compiles": len(compiles),
        "by_status": dict(sorted(by_status.items())),
        "distinct_by_status": dict(sorted(Counter(str(c["status"]) for c in compiles).items())),
        "failures": len(fails),
        "proxy_rejected": sum(1 for r in rows if r["proxy_rejects"]),
        "proxy_rejected_failures": rejected_fail,
        "proxy_rejected_failures_fraction": fraction,
        "proxy_rejected_ok": rejected_ok,
        "by_failure_kind": kinds,
        "resource_failures": _kind(resource, [bool(r["proxy_rejects"]) for r in resource]),
        "resource_rules_only": _kind(fails, [resource_rule_rejects(r) for r in fails]),
        "threshold": PROXY_THRESHOLD,
        "meets_threshold": fraction is not None
        and fraction >= PROXY_THRESHOLD
        and rejected_ok == 0,
    }


def proxy_verdict(
    config: Mapping[str, Any],
    *,
    shape: MoEShape,
    profile: DeviceProfile,
    gemm_index: int,
    triton: str | None,
) -> dict[str, Any]:
    """The resource proxy's verdict on one grid config: rejects, reasons, known failure rule."""
    gemm = GemmConfig(**{k: int(v) for k, v in config.items()})
    est = estimate(
        gemm,
        dtype=shape.dtype,
        profile=profile,
        gemm_index=gemm_index,
        shape=shape,
        triton=triton,
    )
    return {
        "proxy_rejects": not est.fits,
        "proxy_reasons": list(est.reasons),
        "known_failure": est.known_failure,
    }


# -- building ------------------------------------------------------------------------------


def _compile_record(raw: Mapping[str, Any]) -> CompileRecord:
    status = raw["status"]
    return CompileRecord(
        block_m=raw["block_m"],
        block_n=raw["block_n"],
        block_k=raw["block_k"],
        num_warps=raw["num_warps"],
        num_stages=raw["num_stages"],
        status=status,
        error=raw.get("error"),
        smem_bytes=raw.get("shared"),
        smem_required=raw.get("required"),
        smem_limit=raw.get("limit"),
        resource=raw.get("resource"),
        n_regs=raw.get("n_regs"),
        n_spills=raw.get("n_spills"),
        seconds=raw.get("seconds"),
    )


def _control(raw: Mapping[str, Any]) -> GroupControl:
    bm, bn, bk, w, s = raw["tuple"]
    return GroupControl(
        block_m=bm,
        block_n=bn,
        block_k=bk,
        num_warps=w,
        num_stages=s,
        group_m=raw["group_m"],
        status=raw["status"],
        smem_bytes=raw.get("shared"),
        n_regs=raw.get("n_regs"),
        n_spills=raw.get("n_spills"),
        same_as_group1=bool(raw["same_as_group1"]),
    )


def build_survey(
    raw: Mapping[str, Any],
    *,
    milestone: str = "h200-compile-survey",
    profile: DeviceProfile | None = None,
    axes: Mapping[str, Sequence[int]] | None = None,
    grid_name: str = "vllm",
) -> CompileSurvey:
    """The survey document of a ``benchmarks/gpu_survey.py`` survey of one GEMM.

    The grid is vLLM's unless ``axes`` (and a ``grid_name`` other than "vllm") say otherwise;
    every (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the grid must be in the survey.
    ``profile`` defaults to the built-in profile of the surveyed device.
    """
    if (axes is None) != (grid_name == "vllm"):
        raise EvidenceError(
            f"grid {grid_name!r}: pass axes for a grid other than 'vllm' and none for 'vllm'"
        )
    try:
        env = raw["environment"]
        gemm = raw["gemm"]
        fp = Fingerprint(**{k: env.get(k) for k in Fingerprint.model_fields})
        profile = profile or profile_for_device_name(str(env.get("device_name") or ""))
        if profile is None:
            raise EvidenceError(
                f"no built-in device profile for {env.get('device_name')!r}; pass profile="
            )
        if gemm["N"] % 2:
            raise EvidenceError(f"GEMM1's N = 2 x intermediate must be even; got {gemm['N']}")
        shape = MoEShape(gemm["E"], gemm["K"], gemm["N"] // 2, gemm["topk"], gemm["tokens"], "bf16")
        grid_axes = {k: [int(x) for x in v] for k, v in (axes or VLLM_GRID).items()}
        grid_keys = {
            key_of(dict(zip(grid_axes, values, strict=True)))
            for values in itertools.product(*grid_axes.values())
        }
        # only the compilations the grid shares (a survey may cover a larger grid)
        compiles = [_compile_record(r) for r in raw["results"] if key_of(r) in grid_keys]
        controls = [
            _control(r) for r in raw.get("group_m_control", []) if tuple(r["tuple"]) in grid_keys
        ]
    except (KeyError, TypeError, ValueError, ValidationError) as exc:
        raise EvidenceError(
            f"the survey input is not a gpu_survey.py survey: {type(exc).__name__}: {exc}; "
            "give the survey.json that benchmarks/gpu_survey.py wrote"
        ) from None
    index = {key_of(c.model_dump()): i for i, c in enumerate(compiles)}
    if len(index) != len(compiles):
        raise EvidenceError("the survey repeats a compilation; each key must appear once")
    rows: list[GridRow] = []
    missing: list[tuple[int, ...]] = []
    for values in itertools.product(*grid_axes.values()):
        config = dict(zip(grid_axes, values, strict=True))
        i = index.get(key_of(config))
        if i is None:
            missing.append(key_of(config))
            continue
        verdict = proxy_verdict(
            config, shape=shape, profile=profile, gemm_index=1, triton=fp.triton
        )
        rows.append(GridRow(config=config, compile=i, status=compiles[i].status, **verdict))
    if missing:
        raise EvidenceError(
            f"the survey lacks {len(set(missing))} compilations of grid {grid_name!r}, e.g. "
            f"{sorted(set(missing))[:3]} (keys {COMPILE_KEY}); survey the whole grid"
        )
    dumped_rows = [r.model_dump() for r in rows]
    dumped_compiles = [c.model_dump() for c in compiles]
    claims = SurveyClaims(**survey_figures(dumped_rows, dumped_compiles))
    run = SurveyRun(
        workers=raw.get("workers"),
        wall_s=raw.get("wall_s"),
        compile_seconds_sum=raw.get("compile_seconds_sum"),
        group_m_control_wall_s=raw.get("group_m_control_wall_s"),
    )
    notes = [
        "status 'oor' is Triton's out-of-resources error (shared memory); 'compile_error' is a "
        "compiler failure, not a resource failure: the resource rules reject such a config only "
        "when it also exceeds the device's limits; a measured known-failure rule "
        "(mxdb.resources.KNOWN_COMPILE_FAILURES) rejects the rest, and its figure is "
        "in-sample (fitted on this survey)",
        "proxy_rejected_failures_fraction is over every failure; resource_failures is over the "
        "out-of-resource ones; resource_rules_only counts rejections by the resource rules alone",
        f"proxy: mxdb.resources.estimate of GEMM1 under the recorded profile, triton={fp.triton!r}",
    ]
    return CompileSurvey(
        milestone=milestone,
        what=str(raw.get("what", "compile survey")),
        kernel=f"flag_gems {fp.flag_gems} fused_moe_kernel",
        shape=ShapeDoc(**shape.to_dict()),
        gemm_index=1,
        gemm_n=gemm["N"],
        gemm_k=gemm["K"],
        fingerprint=fp,
        fingerprint_hash=fp.hash,
        profile=profile,
        proxy="mxdb.resources.estimate",
        run=run,
        grid=GridDoc(
            name=grid_name,
            source="vLLM benchmarks/kernels/benchmark_moe.py get_configs_compute_bound"
            if grid_name == "vllm"
            else "given axes",
            axes=grid_axes,
            size=len(rows),
            compile_key=list(COMPILE_KEY),
            expansion=EXPANSION,
        ),
        compiles=compiles,
        group_m_control=controls,
        rows=rows,
        claims=claims,
        notes=notes,
    )


def write_survey_bundle(
    out_dir: Path, survey: CompileSurvey, *, bundle_id: str | None = None
) -> Path:
    """Write fingerprint.json, survey.json and (last) manifest.json into an empty ``out_dir``."""
    from mxdb.evidence.writer import write_document_bundle

    return write_document_bundle(
        out_dir,
        kind="survey",
        fingerprint=survey.fingerprint,
        file_name=SURVEY_FILE,
        document=survey.to_json_dict(),
        milestone=survey.milestone,
        bundle_id=bundle_id,
    )
