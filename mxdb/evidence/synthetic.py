"""Synthetic evidence bundles: fake but realistic runs, written with the real writer.

For tests, the audit benchmark and trying ``mxdb audit``/``mxdb report`` without a GPU.
Each comparison group gets one baseline (the anchor config), one A-vs-A control pair of the
anchor, candidates around it (a few percent faster or slower, about 1% sample noise) and a
share of failures (out of resources, compile error, wrong result, timeout).
"""

from __future__ import annotations

import itertools
import random
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mxdb.configs import GemmConfig, KernelConfig
from mxdb.evidence.writer import BundleWriter
from mxdb.fingerprint import recorded
from mxdb.models import Entry, Fingerprint
from mxdb.shapes import MoEShape, memory_floor_bytes
from mxdb.version import __version__

#: The recorded H200 host (``mxdb.fingerprint.H200``) that synthetic bundles claim.
H200 = recorded("h200")

_BY_HASH: dict[str, KernelConfig] = {}
ANCHOR = KernelConfig.uniform(GemmConfig(block_m=16, block_n=128, block_k=64, num_warps=4))
_ERRORS = {"fp16": (0.0009765625, 2.4e-4), "bf16": (0.0078125, 1.9e-3), "fp32": (1e-6, 1e-7)}


def _configs() -> list[KernelConfig]:
    if _BY_HASH:
        return [c for c in _BY_HASH.values() if c != ANCHOR]
    out = []
    for bm, bn, bk, w, s in itertools.product(
        (16, 32, 64), (32, 64, 128), (32, 64, 128), (4, 8), (2, 3, 4)
    ):
        cfg = KernelConfig.uniform(
            GemmConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s)
        )
        _BY_HASH[cfg.hash] = cfg
        if cfg != ANCHOR:
            out.append(cfg)
    return out


def synthetic_bundle(
    out_dir: Path,
    *,
    runs_per_group: int = 8,
    groups: int = 4,
    samples: int = 15,
    seed: int = 0,
    milestone: str = "synthetic-h200",
    failure_rate: float = 0.15,
    fingerprint: Fingerprint = H200,
    bandwidth_bytes_per_s: float | None = 4.27e12,
    report: bool = True,
    store_export: bool = True,
) -> Path:
    """Write a finished bundle of ``groups`` x ``runs_per_group`` runs (at least 4 per group)."""
    if runs_per_group < 4:
        raise ValueError("a group needs a baseline, a control pair and a candidate")
    rng = random.Random(seed)
    configs = _configs()
    w = BundleWriter(
        out_dir, milestone=milestone, fingerprint=fingerprint, bundle_id=f"{milestone}-{seed}"
    )
    models = [(8, 4096, 14336, 2), (128, 2048, 768, 8), (64, 2048, 1408, 6)]
    points = itertools.product(
        models,
        ("bf16", "fp16"),
        (1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
        ("uniform", "skewed", "hot"),
    )
    for gi, ((e, h, i, k), dtype, m, routing) in enumerate(itertools.islice(points, groups)):
        shape = MoEShape(e, h, i, k, m, dtype)
        if routing == "uniform":
            ids = [rng.sample(range(e), k) for _ in range(m)]
        else:
            hot = list(range(max(k, e // 4)))
            ids = [rng.sample(hot, k) for _ in range(m)]
        th = w.add_trace(
            ids,
            experts=e,
            generator={"kind": routing, "seed": seed + gi, "params": {"synthetic": True}},
        )
        floor = memory_floor_bytes(min(e, k * m), h, i, dtype) / 4.27e12 * 1e6
        base_us = floor * rng.uniform(1.25, 1.8) + 6.0
        good = _ERRORS[dtype]

        def timed(center: float) -> list[float]:
            return [round(center * rng.lognormvariate(0.0, 0.01), 4) for _ in range(samples)]

        prefix = f"g{gi:04d}"
        common: dict[str, Any] = {
            "shape": shape,
            "routing_class": routing,
            "trace_hash": th,
            "seed": seed,
            "warmup": 5,
        }
        w.record(
            run_id=f"{prefix}-base",
            config=ANCHOR,
            role="baseline",
            status="ok",
            samples_us=timed(base_us),
            max_abs_err=good[0],
            rel_err=good[1],
            **common,
        )
        for side in "ab":
            w.record(
                run_id=f"{prefix}-ctl-{side}",
                config=ANCHOR,
                role="control",
                status="ok",
                pair_id=f"{prefix}-ctl",
                samples_us=timed(base_us),
                max_abs_err=good[0],
                rel_err=good[1],
                **common,
            )
        for ci, cfg in enumerate(rng.sample(configs, runs_per_group - 3)):
            rid = f"{prefix}-c{ci:03d}"
            if rng.random() < failure_rate:
                kind = rng.choice(("oor", "compile_error", "wrong", "timeout"))
                if kind == "wrong":
                    w.record(
                        run_id=rid,
                        config=cfg,
                        role="candidate",
                        status="wrong",
                        samples_us=timed(base_us * 0.9),
                        max_abs_err=0.75,
                        rel_err=0.2,
                        error="max abs error 0.75 above threshold",
                        **common,
                    )
                else:
                    w.record(
                        run_id=rid,
                        config=cfg,
                        role="candidate",
                        status=kind,
                        error=f"{kind}: synthetic failure",
                        **common,
                    )
                continue
            factor = rng.uniform(0.93, 1.08)
            w.record(
                run_id=rid,
                config=cfg,
                role="candidate",
                status="ok",
                samples_us=timed(base_us / factor),
                max_abs_err=good[0],
                rel_err=good[1],
                **common,
            )
    if store_export:
        w.set_store_export(export_of(w.summary(), fingerprint))
    return w.finish(bandwidth_bytes_per_s=bandwidth_bytes_per_s, report=report)


def export_of(summary: dict[str, Any], fingerprint: Fingerprint) -> dict[str, Any]:
    """An ``mxdb.store-export`` document of a summary's verified configs (as a tune stores them)."""
    entries = []
    for g in summary["groups"]:
        if not g["verified"]:
            continue
        e, h, i, k = (int(x[1:]) for x in g["family"].split("-"))
        cfg = _BY_HASH[g["best_config_hash"]]
        entries.append(
            Entry(
                dtype=g["dtype"],
                family=g["family"],
                dims={
                    "experts": e,
                    "hidden": h,
                    "intermediate": i,
                    "topk": k,
                    "tokens": g["tokens"],
                },
                tokens=g["tokens"],
                routing_class=g["routing_class"],
                config=cfg.model_dump(),
                config_hash=cfg.hash,
                fingerprint_hash=fingerprint.hash,
                device_name=fingerprint.device_name,
                status="verified",
                source="tune",
                speedup=g["speedup"],
                noise_band=g["noise_band"],
                median_us=g["best_median_us"],
                baseline_us=g["baseline_median_us"],
                evidence=g["best_run"],
            ).model_dump(mode="json", exclude={"confidence", "validation"})
        )
    return {
        "schema": "mxdb.store-export",
        "schema_version": "1.0",
        "exported_at": datetime.now(timezone.utc).isoformat(),
        "mxdb_version": __version__,
        "fingerprints": {fingerprint.hash: fingerprint.model_dump(mode="json")},
        "entries": entries,
    }
