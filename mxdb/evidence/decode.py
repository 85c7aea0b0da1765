"""Decode-op evidence: per-shape implementation choices and end-to-end decode benchmarks.

A decode bundle is a directory::

    manifest.json     mxdb.manifest     SHA-256 of every other file (written last)
    fingerprint.json  mxdb.fingerprint  the environment everything was measured in
    decode.json       mxdb.decode       raw samples and the claims derived from them

``decode.json`` holds, for each tuned case (an op at one shape and dtype), every candidate's
raw timing samples and errors with the claimed winner, speedup and noise band; and, for each
benchmarked model, each variant's raw per-step decode times and profiler launch counts with
the claimed tokens/s, launches per token and ratios to the stock model.  The auditor
(:mod:`mxdb.audit.decode`) recomputes every claim with :func:`case_claims` and
:func:`model_claims`.

Definitions: a decode step produces one token for each of ``batch`` sequences, so
``tokens_per_s = batch / median(step_s)``; ``launches_per_token = launches / profiled_steps``
(kernel launches per decode step, i.e. per generated token of a sequence);
``speedup = tokens_per_s(variant) / tokens_per_s(stock)``;
``launch_ratio = launches_per_token(variant) / launches_per_token(stock)``.
The dense model's ``all`` variant meets the target when ``speedup >= 1.5`` and
``launch_ratio <= 0.5``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from mxdb.decode_rule import Candidate, DecodeResult, decide
from mxdb.evidence import stats
from mxdb.evidence.models import _HEX16, _Doc
from mxdb.evidence.thresholds import THRESHOLDS, passes
from mxdb.models import Fingerprint

DECODE_SCHEMA = "mxdb.decode"
DECODE_VERSION = "1.0"
DECODE_FILE = "decode.json"
TARGET_SPEEDUP = 1.5
TARGET_LAUNCH_RATIO = 0.5
STOCK = "stock"
ALL = "all"


class CandidateDoc(_Doc):
    """One implementation of one case: raw samples (us per call) and errors vs float32."""

    impl: str
    role: Literal["baseline", "control", "candidate"]
    status: str
    samples_us: list[float]
    max_abs_err: float | None
    rel_err: float | None
    error: str | None


class CaseClaims(_Doc):
    winner: str
    speedup: float
    noise_band: float | None
    winner_median_us: float
    baseline_median_us: float


class CaseDoc(_Doc):
    """One tuned case: an op at one shape, row count and dtype."""

    op: str
    dtype: Literal["fp16", "bf16", "fp32"]
    dims: dict[str, int]
    tokens: int = Field(ge=1)
    threshold_abs: float
    threshold_rel: float
    candidates: list[CandidateDoc]
    claims: CaseClaims


class VariantDoc(_Doc):
    """One way of running a model: which ops are routed, raw step times and launch counts."""

    name: str
    ops: list[str] = Field(description="decode ops routed through mxdb (empty for stock)")
    step_s: list[float] = Field(min_length=1, description="wall seconds of each decode step")
    launches: int = Field(ge=0, description="kernel launches the profiler counted")
    profiled_steps: int = Field(ge=1)
    max_abs_logit_diff: float | None = Field(description="vs stock, over the compared steps")


class VariantClaims(_Doc):
    tokens_per_s: float
    launches_per_token: float
    speedup: float
    launch_ratio: float


class ModelDoc(_Doc):
    """One benchmarked model (random weights, built from a config)."""

    name: str
    config: dict[str, Any]
    dtype: Literal["fp16", "bf16", "fp32"]
    batch: int = Field(ge=1)
    prompt_len: int = Field(ge=1)
    variants: list[VariantDoc]
    claims: dict[str, VariantClaims]
    meets_target: bool | None = Field(description="dense models: the 'all' variant's target")


class DecodeDoc(_Doc):
    """``decode.json``: decode-op choices and decode benchmarks, raw samples and claims."""

    schema_name: Literal["mxdb.decode"] = Field(default="mxdb.decode", alias="schema")
    schema_version: Literal["1.0"] = "1.0"
    milestone: str = Field(min_length=1)
    fingerprint_hash: str = Field(pattern=_HEX16)
    cases: list[CaseDoc]
    models: list[ModelDoc]


# -- figures (shared by the writer and the auditor) ---------------------------------------------


def case_claims(case: Mapping[str, Any]) -> dict[str, Any]:
    """The claims of a case recomputed from its candidates (the tuner's rule)."""
    cands = [
        Candidate(
            c["impl"],
            c["role"],
            c["status"],
            tuple(float(x) for x in c["samples_us"]),
            c["max_abs_err"],
            c["rel_err"],
            c.get("error"),
        )
        for c in case["candidates"]
    ]
    winner, speedup, band, _ = decide(case["dtype"], cands)
    base = next(c for c in cands if c.role == "baseline")
    win = next((c for c in cands if c.impl == winner and c.role != "control"), base)
    return {
        "winner": winner,
        "speedup": speedup,
        "noise_band": band,
        "winner_median_us": stats.median(win.samples_us),
        "baseline_median_us": stats.median(base.samples_us),
    }


def variant_figures(v: Mapping[str, Any], batch: int) -> tuple[float, float]:
    """``(tokens_per_s, launches_per_token)`` of a variant from its raw figures.

    Launches per token are per decode step: a step produces the next token of every sequence
    of the batch with one pass of the model, whose launches do not grow with the batch.
    """
    return batch / stats.median([float(x) for x in v["step_s"]]), v["launches"] / v[
        "profiled_steps"
    ]


def model_claims(model: Mapping[str, Any]) -> tuple[dict[str, dict[str, float]], bool | None]:
    """Every variant's claims and the target verdict, recomputed from the raw figures."""
    batch = int(model["batch"])
    figs = {v["name"]: variant_figures(v, batch) for v in model["variants"]}
    if STOCK not in figs:
        return {}, None
    tps0, lpt0 = figs[STOCK]
    claims = {
        name: {
            "tokens_per_s": tps,
            "launches_per_token": lpt,
            "speedup": tps / tps0,
            "launch_ratio": lpt / lpt0 if lpt0 else 0.0,
        }
        for name, (tps, lpt) in figs.items()
    }
    meets = None
    if ALL in claims and not model["config"].get("moe", False):
        a = claims[ALL]
        meets = a["speedup"] >= TARGET_SPEEDUP and a["launch_ratio"] <= TARGET_LAUNCH_RATIO
    return claims, meets


# -- writers --------------------------------------------------------------------------------------


def case_doc(result: DecodeResult) -> dict[str, Any]:
    """The ``CaseDoc`` (as JSON) of a tuner result."""
    case = result.case
    t = THRESHOLDS[case.dtype]
    doc: dict[str, Any] = {
        "op": case.op,
        "dtype": case.dtype,
        "dims": dict(case.dims),
        "tokens": case.tokens,
        "threshold_abs": t.max_abs,
        "threshold_rel": t.max_rel,
        "candidates": [
            {
                "impl": c.impl,
                "role": c.role,
                "status": c.status,
                "samples_us": list(c.samples_us),
                "max_abs_err": c.max_abs_err,
                "rel_err": c.rel_err,
                "error": c.error,
            }
            for c in result.candidates
        ],
    }
    doc["claims"] = case_claims(doc)
    return doc


def model_doc(
    *,
    name: str,
    config: Mapping[str, Any],
    dtype: str,
    batch: int,
    prompt_len: int,
    variants: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """A ``ModelDoc`` (as JSON) with its claims computed from the raw variant figures."""
    doc: dict[str, Any] = {
        "name": name,
        "config": dict(config),
        "dtype": dtype,
        "batch": batch,
        "prompt_len": prompt_len,
        "variants": [dict(v) for v in variants],
    }
    claims, meets = model_claims(doc)
    doc["claims"] = claims
    doc["meets_target"] = meets
    return doc


def write_decode_bundle(
    root: Path,
    *,
    fingerprint: Fingerprint,
    milestone: str,
    cases: Sequence[Mapping[str, Any]],
    models: Sequence[Mapping[str, Any]],
) -> Path:
    """Write fingerprint.json, decode.json (validated), then the manifest, into empty ``root``."""
    from mxdb.errors import EvidenceError
    from mxdb.evidence.writer import write_document_bundle

    for c in cases:
        if not passes(c["dtype"], 0.0, 0.0):  # the dtype must be one the table knows
            raise EvidenceError(f"case dtype {c['dtype']!r} has no thresholds")
    doc = DecodeDoc(
        milestone=milestone,
        fingerprint_hash=fingerprint.hash,
        cases=[CaseDoc.model_validate(c) for c in cases],
        models=[ModelDoc.model_validate(m) for m in models],
    )
    return write_document_bundle(
        root,
        kind="decode",
        fingerprint=fingerprint,
        file_name=DECODE_FILE,
        document=doc.to_json_dict(),
        milestone=milestone,
    )
