"""Where the fused MoE layer's GPU time goes (``stages.json``, ``mxdb.stages`` 1.0).

Per point (model family, token count M, routing), one GPU, one process, one config (FlagGems'
own choice unless stated), the pipeline's stages timed as CUDA graphs of their own launches,
interleaved in a random order per round, next to the whole layer's graph:

- ``align``: the memset of the alignment counts, the sort/align kernels and the expansion of
  expert ids per tile (absent below the size where the pipeline skips alignment);
- ``gemm1``: the first grouped GEMM (gate and up projections);
- ``activation``: SiLU-and-mul;
- ``gemm2``: the second grouped GEMM (down projection);
- ``sum``: the reduction of each token's ``k`` expert outputs;
- ``layer``: the whole call.

The routing is recorded as its generator (``mxdb.routing_gen`` kind, seed, parameters), so the
auditor regenerates the ids and recomputes the experts a call touches.  Figures
(:func:`point_figures` per point, :func:`build_figures` over points; the auditor recomputes
both with these functions): each stage's median and share of the stages' sum, the GEMMs'
share, the stages' sum over the layer, and the memory-bound floor (the bytes of the touched
experts' weights, ``mxdb.shapes.memory_floor_bytes``) over the layer's median, with the
device-to-device copy bandwidth and with a streaming-read bandwidth, both measured in the
run; the compute floor (the layer's FLOPs, ``6 M k H I``, at the dense bf16 matmul rate
measured in the run) and the bound (the larger of the two floors, with the copy bandwidth)
over the layer's median; geometric means by size (decode: M <= 16; large: M >= 64) and
routing (uniform; skewed: every other kind).

Schema 1.1 profiles any layer implementation (the config's ``impl``), so a profile of mxdb's
dispatch can stand beside one of FlagGems' own config.  A point records ``impl`` and, where
the config was mxdb's dispatch for the point's routing class, ``dispatch_reason``; the document
records ``config_source`` (``flaggems``: FlagGems' own choice at every point; ``dispatch``:
mxdb's answer from a store export).  The stages each implementation has
(:func:`stages_of`):

- ``flaggems``: ``gemm1``, ``activation``, ``gemm2``, ``sum`` as above;
- ``fused_act``: ``gemm1`` is the first GEMM with SiLU-and-mul in its epilogue (no
  ``activation`` stage), then ``gemm2`` and ``sum``;
- ``fused_slice``: ``fused``, the one kernel of both GEMMs, SiLU-and-mul, the routing weights
  and the top-k sum (float32 atomic adds), and ``sum``, its launch that casts the float32 sums
  to the output dtype and clears them.

A stage an implementation does not have has no samples and a median of 0; the GEMM share
counts ``gemm1``, ``gemm2`` and ``fused``.  Documents of schema 1.0 have the five stages of
FlagGems' pipeline and no ``fused``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
from pydantic import Field

from mxdb import routing_gen
from mxdb.evidence import stats
from mxdb.evidence.cells import cell
from mxdb.evidence.models import ShapeDoc, _Doc, optional_fields
from mxdb.evidence.peers import DECODE_MAX_TOKENS
from mxdb.shapes import memory_floor_bytes

STAGES_FILE = "stages.json"
REPORT_FILE = "report/stages.md"
SCHEMA = "mxdb.stages"
SCHEMA_VERSION = "1.1"
LARGE_MIN_TOKENS = 64
#: the stages of documents of schema 1.0 (FlagGems' pipeline), in call order
STAGES_1_0: tuple[str, ...] = ("align", "gemm1", "activation", "gemm2", "sum")
#: every stage of schema 1.1, in call order (``fused``: fused_slice's one kernel)
STAGES: tuple[str, ...] = ("align", "gemm1", "activation", "gemm2", "fused", "sum")
SERIES: tuple[str, ...] = (*STAGES, "layer")
#: the stages with samples of each layer implementation, besides ``align`` (module docstring)
IMPL_STAGES: dict[str, tuple[str, ...]] = {
    "flaggems": ("gemm1", "activation", "gemm2", "sum"),
    "fused_act": ("gemm1", "gemm2", "sum"),
    "fused_slice": ("fused", "sum"),
}
#: what chose each point's config (``config_source`` of schema 1.1)
CONFIG_SOURCES = ("flaggems", "dispatch")


def stages_of(version: str) -> tuple[str, ...]:
    """The stages a document of schema ``version`` times (with ``align``)."""
    return STAGES_1_0 if version == "1.0" else STAGES


def impl_of(config: Mapping[str, Any]) -> str:
    """A recorded config's layer implementation (the default is left out of its dump)."""
    return str(config.get("impl", "flaggems"))


class RoutingDoc(_Doc):
    """How a point's top-k ids were generated (``mxdb.routing_gen.generate``)."""

    kind: Literal["uniform", "zipf", "hot", "sparse", "logits"]
    seed: int = Field(ge=0)
    params: dict[str, float | int]


class StagePoint(_Doc):
    """One point: its inputs, raw samples (us per call, one per round) and derived figures."""

    model_config = optional_fields("impl", "dispatch_reason")

    family: str
    tokens: int = Field(ge=1)
    shape: ShapeDoc
    routing: RoutingDoc
    config: dict[str, Any]
    config_hash: str
    impl: str | None = Field(
        default=None, description="schema 1.1: the config's layer implementation"
    )
    dispatch_reason: str | None = Field(
        default=None,
        description="schema 1.1, config_source dispatch: the dispatcher's reason for the config",
    )
    samples: dict[str, list[float]]
    active_experts: int
    median_us: dict[str, float]
    share: dict[str, float]
    gemm_share: float
    stages_over_layer: float
    floor_us_copy: float
    floor_us_read: float
    floor_fraction_copy: float
    floor_fraction_read: float
    gemm_floor_fraction_copy: float
    compute_floor_us: float
    bound_fraction: float


class Bandwidth(_Doc):
    """Bandwidth samples (bytes per second) and their medians."""

    copy_samples: list[float] = Field(min_length=1)
    read_samples: list[float] = Field(min_length=1)
    matmul_samples: list[float] = Field(min_length=1)
    copy_bytes_per_s: float
    read_bytes_per_s: float
    matmul_flops_per_s: float


class StagesDoc(_Doc):
    """``stages.json``: the stage profile of one run."""

    model_config = optional_fields("config_source")

    schema_name: Literal["mxdb.stages"] = Field(default="mxdb.stages", alias="schema")
    schema_version: Literal["1.0", "1.1"] = "1.1"
    milestone: str
    fingerprint_hash: str
    config_source: Literal["flaggems", "dispatch"] | None = Field(
        default=None, description="schema 1.1: what chose each point's config"
    )
    decode_max_tokens: int
    large_min_tokens: int
    bandwidth: Bandwidth
    points: list[StagePoint]
    figures: dict[str, float | int | None]
    errors: list[str]


def touched_experts(routing: Mapping[str, Any], tokens: int, experts: int, topk: int) -> int:
    """The number of experts the regenerated routing sends at least one token to."""
    ids = routing_gen.generate(
        str(routing["kind"]), tokens, experts, topk, int(routing["seed"]), **routing["params"]
    )
    return int(np.unique(np.asarray(ids)).size)


def bandwidth_figures(
    copy_samples: Sequence[float], read_samples: Sequence[float], matmul_samples: Sequence[float]
) -> dict[str, Any]:
    """The ``bandwidth`` block: the samples (bytes/s, bytes/s, FLOP/s) and their medians."""
    return {
        "copy_samples": list(copy_samples),
        "read_samples": list(read_samples),
        "matmul_samples": list(matmul_samples),
        "copy_bytes_per_s": stats.median(copy_samples),
        "read_bytes_per_s": stats.median(read_samples),
        "matmul_flops_per_s": stats.median(matmul_samples),
    }


def point_figures(
    point: Mapping[str, Any], bandwidth: Mapping[str, Any], version: str = SCHEMA_VERSION
) -> dict[str, Any]:
    """A point's derived fields from its samples, routing and the run's bandwidths."""
    shape = point["shape"]
    samples = point["samples"]
    stages = stages_of(version)
    med = {s: (stats.median(samples[s]) if samples.get(s) else 0.0) for s in (*stages, "layer")}
    total = sum(med[s] for s in stages)
    gemms = med["gemm1"] + med["gemm2"] + med.get("fused", 0.0)
    active = touched_experts(point["routing"], shape["tokens"], shape["experts"], shape["topk"])
    nbytes = memory_floor_bytes(active, shape["hidden"], shape["intermediate"], shape["dtype"])
    floor_copy = nbytes / float(bandwidth["copy_bytes_per_s"]) * 1e6
    floor_read = nbytes / float(bandwidth["read_bytes_per_s"]) * 1e6
    layer = med["layer"]
    flops = 6 * shape["tokens"] * shape["topk"] * shape["hidden"] * shape["intermediate"]
    compute = flops / float(bandwidth["matmul_flops_per_s"]) * 1e6
    return {
        "active_experts": active,
        "median_us": med,
        "share": {s: med[s] / total for s in stages},
        "gemm_share": gemms / total,
        "stages_over_layer": total / layer,
        "floor_us_copy": floor_copy,
        "floor_us_read": floor_read,
        "floor_fraction_copy": floor_copy / layer,
        "floor_fraction_read": floor_read / layer,
        "gemm_floor_fraction_copy": floor_copy / gemms,
        "compute_floor_us": compute,
        "bound_fraction": max(floor_copy, compute) / layer,
    }


def build_figures(
    points: Sequence[Mapping[str, Any]], decode_max_tokens: int, large_min_tokens: int
) -> dict[str, float | int | None]:
    """Geometric means over the points by size and routing (module docstring)."""
    out: dict[str, float | int | None] = {"n_points": len(points)}
    groups: dict[str, Callable[[Mapping[str, Any]], bool]] = {
        "decode_uniform": lambda p: p["tokens"] <= decode_max_tokens and _uniform(p),
        "decode_skewed": lambda p: p["tokens"] <= decode_max_tokens and not _uniform(p),
        "large_uniform": lambda p: p["tokens"] >= large_min_tokens and _uniform(p),
        "large_skewed": lambda p: p["tokens"] >= large_min_tokens and not _uniform(p),
        "all": lambda p: True,
    }
    for name, keep in groups.items():
        sel = [p for p in points if keep(p)]
        out[f"n_{name}"] = len(sel)
        for fig in ("floor_fraction_copy", "floor_fraction_read", "bound_fraction", "gemm_share"):
            out[f"{name}_geomean_{fig}"] = stats.geomean(p[fig] for p in sel)
    return out


def _uniform(p: Mapping[str, Any]) -> bool:
    return bool(p["routing"]["kind"] == "uniform")


def build_stages(
    points: Sequence[Mapping[str, Any]],
    *,
    milestone: str,
    fingerprint_hash: str,
    copy_samples: Sequence[float],
    read_samples: Sequence[float],
    matmul_samples: Sequence[float],
    errors: Sequence[str] = (),
    decode_max_tokens: int = DECODE_MAX_TOKENS,
    large_min_tokens: int = LARGE_MIN_TOKENS,
    config_source: str = "flaggems",
) -> dict[str, Any]:
    """The whole document (schema 1.1) from the points' inputs and raw samples (every figure
    derived); a point may carry ``dispatch_reason``, and its ``impl`` is its config's."""
    if config_source not in CONFIG_SOURCES:
        raise ValueError(f"config_source {config_source!r}: one of {', '.join(CONFIG_SOURCES)}")
    bw = bandwidth_figures(copy_samples, read_samples, matmul_samples)
    full = [
        {**p, "impl": impl_of(p["config"]), "dispatch_reason": p.get("dispatch_reason"),
         **point_figures(p, bw)}
        for p in points
    ]  # fmt: skip
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "milestone": milestone,
        "fingerprint_hash": fingerprint_hash,
        "config_source": config_source,
        "decode_max_tokens": decode_max_tokens,
        "large_min_tokens": large_min_tokens,
        "bandwidth": bw,
        "points": full,
        "figures": build_figures(full, decode_max_tokens, large_min_tokens),
        "errors": list(errors),
    }


def render(doc: Mapping[str, Any]) -> str:
    """``report/stages.md``: a view of ``stages.json`` (the audit checks the JSON)."""

    f = doc["figures"]
    bw = doc["bandwidth"]
    version = str(doc["schema_version"])
    stages = stages_of(version)
    title = "# Where the fused MoE layer's GPU time goes"
    if version != "1.0":
        title += (
            ": mxdb's dispatch" if doc.get("config_source") == "dispatch"
            else ": FlagGems' own config"
        )  # fmt: skip
    lines = [
        title,
        "",
        f"Bandwidth: device-to-device copy {bw['copy_bytes_per_s'] / 1e12:.2f} TB/s, streaming read "
        f"{bw['read_bytes_per_s'] / 1e12:.2f} TB/s, dense bf16 matmul "
        f"{bw['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s (medians). Floor: the touched experts' "
        "weight bytes over each bandwidth; bound: the larger of that (copy) and the FLOPs at the "
        "matmul rate.",
        "",
        "| group | points | floor fraction (copy) | floor fraction (read) | bound fraction | "
        "GEMM share |",
        "|---|---|---|---|---|---|",
    ]
    for g in ("decode_uniform", "decode_skewed", "large_uniform", "large_skewed", "all"):
        lines.append(
            f"| {g} | {f[f'n_{g}']} | {cell(f[f'{g}_geomean_floor_fraction_copy'])} | "
            f"{cell(f[f'{g}_geomean_floor_fraction_read'])} | "
            f"{cell(f[f'{g}_geomean_bound_fraction'])} | {cell(f[f'{g}_geomean_gemm_share'])} |"
        )
    heads = {"activation": "act"}
    extra = version != "1.0"  # 1.1: the implementation and the dispatcher's reason
    cols = [
        "family", "M", "routing", *(["impl"] if extra else []), "touched", "layer us",
        *(heads.get(s, s) for s in stages), "floor (copy)", "bound",
        *(["dispatch"] if extra else []),
    ]  # fmt: skip
    lines += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for p in doc["points"]:
        m = p["median_us"]
        impl = [str(p.get("impl"))] if extra else []
        why = [str(p.get("dispatch_reason") or "-")] if extra else []
        row = [
            p["family"], str(p["tokens"]), p["routing"]["kind"], *impl, str(p["active_experts"]),
            cell(m["layer"], ".1f"), *(cell(m[s], ".1f") for s in stages),
            cell(p["floor_fraction_copy"]), cell(p["bound_fraction"]), *why,
        ]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    if doc["errors"]:
        lines += ["", "Errors:", *(f"- {e}" for e in doc["errors"])]
    return "\n".join(lines) + "\n"
