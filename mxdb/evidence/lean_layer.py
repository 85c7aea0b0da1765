"""The lean MoE layer's eager cost (``lean_layer.json``, ``mxdb.lean-layer`` 1.0), from raw samples.

Per point (model family, token count M, uniform routing), one GPU, one process, the config mxdb
dispatches, interleaved timings whose raw samples the document carries:

- ``graph_layer``: CUDA-graph replay of ``MoELayer`` calls (GPU time only);
- ``eager_*`` (back-to-back): N plain calls between two events, divided by N, for the layer,
  FlagGems' ``fused_experts_impl``, the layer with per-M graphs, and the bare pipeline;
- ``synced_*`` (per call): host clock around one call and ``torch.cuda.synchronize()``;
- ``host_us``: host time to issue one call (best of 5 means, no synchronization; a host
  measurement reported as measured) and ``profile``: the host-time profile tables as recorded.

Figures (medians are ``stats.median`` of the raw samples; :func:`build_lean_layer` computes them
and the auditor recomputes them with the same function):

- ``eager_over_graph_layer`` = median(eager_layer) / median(graph_layer), likewise
  ``eager_over_graph_layer_graphs`` and ``synced_over_graph_layer``;
- ``eager_speedup_layer_over_fused_experts_impl`` = median(eager_fused_experts_impl) /
  median(eager_layer), ``synced_speedup_...`` likewise, ``host_speedup_...`` from ``host_us``;
- ``decode_*``: geometric means (and the maximum of eager/graph) over points with M at most
  ``decode_max_tokens``; ``all_*``: over every point;
- each target: its figure, a fixed threshold and comparison, and ``passed``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import Field

from mxdb.evidence import stats
from mxdb.evidence.cells import cell
from mxdb.evidence.models import Correctness, ShapeDoc, _Doc
from mxdb.evidence.peers import (
    DECODE_MAX_TOKENS,
    Target,
    TargetSpec,
    build_targets,
    targets_markdown,
)

LEAN_LAYER_FILE = "lean_layer.json"
REPORT_FILE = "report/lean_layer.md"
SCHEMA = "mxdb.lean-layer"
SCHEMA_VERSION = "1.0"
#: sample series -> what it times
SERIES: dict[str, str] = {
    "graph_layer": "CUDA-graph replay of MoELayer calls",
    "eager_layer": "MoELayer, back-to-back eager calls between events, per call",
    "eager_fused_experts_impl": "FlagGems fused_experts_impl, back-to-back eager calls, per call",
    "eager_layer_graphs": "MoELayer with per-M CUDA graphs, back-to-back eager calls, per call",
    "eager_pipeline": "the unrecorded MoEPipeline, back-to-back eager calls, per call",
    "synced_layer": "MoELayer, host clock around one call and a synchronize",
    "synced_fused_experts_impl": "fused_experts_impl, host clock around one call and a synchronize",
    "synced_layer_graphs": "MoELayer with graphs, host clock around one call and a synchronize",
}
HOST_KEYS: tuple[str, ...] = ("layer", "fused_experts_impl", "layer_graphs", "pipeline")

#: The lean layer's targets (fixed here: the auditor checks a document's thresholds).
TARGETS: tuple[TargetSpec, ...] = (
    TargetSpec(
        name="decode_eager_near_graph",
        figure="decode_max_eager_over_graph_layer",
        comparison="le",
        threshold=1.3,
        statement="at every decode point (M <= 16) an eager MoELayer call is within 1.3x of "
        "its own CUDA-graph replay time (the largest ratio)",
    ),
    TargetSpec(
        name="decode_eager_faster_than_fused_experts_impl",
        figure="decode_geomean_eager_speedup_layer_over_fused_experts_impl",
        comparison="ge",
        threshold=2.0,
        statement="at decode (M <= 16) an eager MoELayer call is at least 2x faster than "
        "FlagGems' eager fused_experts_impl call, geomean",
    ),
    TargetSpec(
        name="decode_synced_faster_than_fused_experts_impl",
        figure="decode_geomean_synced_speedup_layer_over_fused_experts_impl",
        comparison="ge",
        threshold=1.0,
        statement="at decode (M <= 16) one synchronized MoELayer call is at least as fast as "
        "one synchronized fused_experts_impl call, geomean (mxdb's own check of the "
        "per-call synchronized variant; the issue sets no threshold for it)",
    ),
)


class LeanSamples(_Doc):
    """The raw samples of one point (microseconds per layer call)."""

    graph_layer: list[float] = Field(min_length=1)
    eager_layer: list[float] = Field(min_length=1)
    eager_fused_experts_impl: list[float] = Field(min_length=1)
    eager_layer_graphs: list[float] = Field(min_length=1)
    eager_pipeline: list[float] = Field(min_length=1)
    synced_layer: list[float] = Field(min_length=1)
    synced_fused_experts_impl: list[float] = Field(min_length=1)
    synced_layer_graphs: list[float] = Field(min_length=1)


class LeanHost(_Doc):
    """Host time to issue one call, microseconds (best of 5 means; as measured)."""

    layer: float
    fused_experts_impl: float
    layer_graphs: float
    pipeline: float


class LeanPoint(_Doc):
    """One point: its inputs, raw samples and the figures derived from them."""

    family: str
    tokens: int = Field(ge=1)
    shape: ShapeDoc
    config: dict[str, Any]
    config_hash: str
    config_is_flaggems: bool
    launches: int | None
    record_error: str | None
    correctness: Correctness
    identical_to_fused_experts_impl: bool | None
    samples: LeanSamples
    host_us: LeanHost
    median_us: dict[str, float]
    p90_us: dict[str, float]
    eager_over_graph_layer: float
    eager_over_graph_layer_graphs: float
    synced_over_graph_layer: float
    eager_speedup_layer_over_fused_experts_impl: float
    synced_speedup_layer_over_fused_experts_impl: float
    host_speedup_layer_over_fused_experts_impl: float


class LeanFigures(_Doc):
    """Aggregates over decode points (M <= ``decode_max_tokens``) and over all points."""

    n_points: int
    n_decode_points: int
    decode_geomean_eager_over_graph_layer: float | None
    decode_max_eager_over_graph_layer: float | None
    decode_geomean_eager_over_graph_layer_graphs: float | None
    decode_geomean_synced_over_graph_layer: float | None
    decode_geomean_eager_speedup_layer_over_fused_experts_impl: float | None
    decode_geomean_synced_speedup_layer_over_fused_experts_impl: float | None
    decode_geomean_host_speedup_layer_over_fused_experts_impl: float | None
    all_geomean_eager_over_graph_layer: float | None
    all_geomean_eager_speedup_layer_over_fused_experts_impl: float | None


class LeanLayerDoc(_Doc):
    """``lean_layer.json``: the lean MoE layer's eager, synced and host cost against FlagGems."""

    schema_name: Literal["mxdb.lean-layer"] = Field(default="mxdb.lean-layer", alias="schema")
    schema_version: Literal["1.0"] = "1.0"
    milestone: str
    fingerprint_hash: str
    decode_max_tokens: int
    series: dict[str, str] = Field(description="sample series -> what it times")
    points: list[LeanPoint]
    figures: LeanFigures
    targets: list[Target]
    profile: dict[str, str] = Field(
        description="per family: the host-time profile table of 20 calls at M=4, as recorded"
    )
    errors: list[str]


def point_figures(
    samples: Mapping[str, Sequence[float]], host: Mapping[str, float]
) -> dict[str, Any]:
    """The figures of one point from its raw samples and host times."""
    med = {k: stats.median([float(x) for x in samples[k]]) for k in SERIES}
    p90 = {k: stats.p90([float(x) for x in samples[k]]) for k in SERIES}
    g = med["graph_layer"]
    return {
        "median_us": med,
        "p90_us": p90,
        "eager_over_graph_layer": med["eager_layer"] / g,
        "eager_over_graph_layer_graphs": med["eager_layer_graphs"] / g,
        "synced_over_graph_layer": med["synced_layer"] / g,
        "eager_speedup_layer_over_fused_experts_impl": stats.speedup(
            med["eager_fused_experts_impl"], med["eager_layer"]
        ),
        "synced_speedup_layer_over_fused_experts_impl": stats.speedup(
            med["synced_fused_experts_impl"], med["synced_layer"]
        ),
        "host_speedup_layer_over_fused_experts_impl": float(host["fused_experts_impl"])
        / float(host["layer"]),
    }


def aggregate(points: Sequence[Mapping[str, Any]], decode_max_tokens: int) -> dict[str, Any]:
    """The aggregate figures over the points."""
    dec = [p for p in points if int(p["tokens"]) <= decode_max_tokens]

    def gm(rows: Sequence[Mapping[str, Any]], key: str) -> float | None:
        return stats.geomean(float(r[key]) for r in rows)

    e_over_g = [float(p["eager_over_graph_layer"]) for p in dec]
    return {
        "n_points": len(points),
        "n_decode_points": len(dec),
        "decode_geomean_eager_over_graph_layer": gm(dec, "eager_over_graph_layer"),
        "decode_max_eager_over_graph_layer": max(e_over_g) if e_over_g else None,
        "decode_geomean_eager_over_graph_layer_graphs": gm(dec, "eager_over_graph_layer_graphs"),
        "decode_geomean_synced_over_graph_layer": gm(dec, "synced_over_graph_layer"),
        "decode_geomean_eager_speedup_layer_over_fused_experts_impl": gm(
            dec, "eager_speedup_layer_over_fused_experts_impl"
        ),
        "decode_geomean_synced_speedup_layer_over_fused_experts_impl": gm(
            dec, "synced_speedup_layer_over_fused_experts_impl"
        ),
        "decode_geomean_host_speedup_layer_over_fused_experts_impl": gm(
            dec, "host_speedup_layer_over_fused_experts_impl"
        ),
        "all_geomean_eager_over_graph_layer": gm(points, "eager_over_graph_layer"),
        "all_geomean_eager_speedup_layer_over_fused_experts_impl": gm(
            points, "eager_speedup_layer_over_fused_experts_impl"
        ),
    }


#: the fields of a point that are inputs (everything else is computed)
POINT_INPUTS: tuple[str, ...] = (
    "family",
    "tokens",
    "shape",
    "config",
    "config_hash",
    "config_is_flaggems",
    "launches",
    "record_error",
    "correctness",
    "identical_to_fused_experts_impl",
    "samples",
    "host_us",
)


def build_lean_layer(
    points: Sequence[Mapping[str, Any]],
    *,
    milestone: str,
    fingerprint_hash: str,
    decode_max_tokens: int = DECODE_MAX_TOKENS,
    targets: Sequence[TargetSpec | Mapping[str, Any]] = TARGETS,
    profile: Mapping[str, str] | None = None,
    errors: Sequence[str] = (),
) -> dict[str, Any]:
    """The ``lean_layer.json`` document: each point's inputs (:data:`POINT_INPUTS`) + figures."""
    rows = []
    for p in points:
        rows.append(
            {**{k: p[k] for k in POINT_INPUTS}, **point_figures(p["samples"], p["host_us"])}
        )
    figures = aggregate(rows, decode_max_tokens)
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "milestone": milestone,
        "fingerprint_hash": fingerprint_hash,
        "decode_max_tokens": decode_max_tokens,
        "series": dict(SERIES),
        "points": rows,
        "figures": figures,
        "targets": build_targets(figures, targets),
        "profile": dict(profile or {}),
        "errors": list(errors),
    }


def render(doc: Mapping[str, Any]) -> str:
    """``report/lean_layer.md``: a view of ``lean_layer.json`` (the audit checks the JSON)."""

    f = doc["figures"]
    lines = [
        "# The lean MoE layer: eager against graph replay and FlagGems' fused_experts_impl",
        "",
        f"- decode (M <= {doc['decode_max_tokens']}, {f['n_decode_points']} points): eager/graph "
        f"of MoELayer {cell(f['decode_geomean_eager_over_graph_layer'])} (geomean, max "
        f"{cell(f['decode_max_eager_over_graph_layer'])}); eager MoELayer "
        f"{cell(f['decode_geomean_eager_speedup_layer_over_fused_experts_impl'])}x faster than "
        f"fused_experts_impl; per-call synced "
        f"{cell(f['decode_geomean_synced_speedup_layer_over_fused_experts_impl'])}x; host time "
        f"{cell(f['decode_geomean_host_speedup_layer_over_fused_experts_impl'])}x",
        "",
        "| family | M | graph us | eager us | eager/graph | fei eager us | fei/layer eager | "
        "synced fei/layer | host layer us | host fei us |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in doc["points"]:
        m, h = p["median_us"], p["host_us"]
        lines.append(
            f"| {p['family']} | {p['tokens']} | {cell(m['graph_layer'])} | {cell(m['eager_layer'])} | "
            f"{cell(p['eager_over_graph_layer'])} | {cell(m['eager_fused_experts_impl'])} | "
            f"{cell(p['eager_speedup_layer_over_fused_experts_impl'])} | "
            f"{cell(p['synced_speedup_layer_over_fused_experts_impl'])} | {cell(h['layer'])} | "
            f"{cell(h['fused_experts_impl'])} |"
        )
    lines += ["", *targets_markdown(doc["targets"])]
    return "\n".join(lines) + "\n"
