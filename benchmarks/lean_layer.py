"""The lean MoE layer's eager cost on one GPU: eager calls against graph replay and FlagGems.

Usage (GPU host): python benchmarks/lean_layer.py OUT.json [--store-export EXPORT.json]
Usage (anywhere): python benchmarks/lean_layer.py publish OUT.json evidence/h200-lean-layer

For Mixtral-8x7B and Qwen3-30B-A3B (bf16, uniform routing) at M in {1, 2, 4, 8, 16, 64, 256},
with the config mxdb dispatches (FlagGems' own choice where the store has none), interleaved:

* ``graph``: CUDA-graph replay of ``MoELayer`` calls (GPU time, no host cost);
* ``eager`` (back-to-back): N plain calls between two events, no host synchronization, divided
  by N: what an eager decode loop pays per layer call (the GPU waits for the host when the host
  is slower).  Both ``MoELayer`` and FlagGems' ``fused_experts_impl`` (its whole call: config
  lookup, allocation, logging, launches);
* ``synced`` (per call): host clock around one call followed by ``torch.cuda.synchronize()``
  (do_bench-like; includes the launch latency and the synchronization);
* ``host``: host time to issue one call (``perf_counter_ns``, no synchronization) for the layer,
  the unrecorded pipeline (FlagGems' launch path) and ``fused_experts_impl``.

``publish`` writes an evidence bundle from OUT.json: ``fingerprint.json`` (the environment the
raw output recorded), ``lean_layer.json`` (``mxdb.lean-layer``: the raw samples, every figure
and each target with its threshold, measured value and verdict, all recomputed by
``mxdb audit``) and ``report/lean_layer.md``.
"""

# ruff: noqa: B023  (the timed lambdas run before their loop variables change)
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from mxdb.fileio import atomic_write_text

TOKENS = (1, 2, 4, 8, 16, 64, 256)


def atomic_json(path: Path, doc: Any) -> None:
    atomic_write_text(path, json.dumps(doc))


def synced(torch: Any, fn: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter_ns() - t0) / 1000)
    return out


def host(torch: Any, fn: Any, n: int) -> float:
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / n / 1000)
        torch.cuda.synchronize()
    return best


SERIES_KEYS = {
    "eager_layer": ("eager_us", "layer"),
    "eager_fused_experts_impl": ("eager_us", "fused_experts_impl"),
    "eager_layer_graphs": ("eager_us", "layer_graphs"),
    "eager_pipeline": ("eager_us", "pipeline"),
    "synced_layer": ("synced_us", "layer"),
    "synced_fused_experts_impl": ("synced_us", "fused_experts_impl"),
    "synced_layer_graphs": ("synced_us", "layer_graphs"),
}


def publish(raw_path: Path, bundle: Path) -> None:
    """Write the lean-layer evidence bundle from the raw JSON (figures computed by mxdb)."""

    from mxdb.configs import config_hash
    from mxdb.evidence.lean_layer import (
        LEAN_LAYER_FILE,
        REPORT_FILE,
        LeanLayerDoc,
        build_lean_layer,
        render,
    )
    from mxdb.evidence.writer import make_correctness, publish_bundle
    from mxdb.models import Fingerprint
    from mxdb.shapes import preset_shape

    milestone = "h200-lean-layer"
    raw = json.loads(raw_path.read_text())
    fp = Fingerprint(**raw["fingerprint"])
    points = []
    for p in raw["points"]:
        shape = preset_shape(p["family"], p["tokens"], "bf16")
        err, rel, _ = p["correct"]
        samples = {"graph_layer": p["graph_us"]}
        samples.update({k: p[a][b] for k, (a, b) in SERIES_KEYS.items()})
        points.append(
            {
                "family": p["family"],
                "tokens": p["tokens"],
                "shape": shape.to_dict(),
                "config": p["config"],
                "config_hash": config_hash(p["config"]),
                "config_is_flaggems": p["config_is_flaggems"],
                "launches": p["launches"],
                "record_error": p["record_error"],
                "correctness": make_correctness("bf16", err, rel).to_json_dict(),
                "identical_to_fused_experts_impl": p["identical_to_fused_experts_impl"],
                "samples": samples,
                "host_us": p["host_us"],
            }
        )
    doc = build_lean_layer(
        points,
        milestone=milestone,
        fingerprint_hash=fp.hash,
        profile=raw.get("profile") or {},
        errors=raw.get("errors", []),
    )
    doc = LeanLayerDoc.model_validate(doc).to_json_dict()
    publish_bundle(
        bundle,
        fingerprint=fp,
        files={LEAN_LAYER_FILE: doc, REPORT_FILE: render(doc)},
        milestone=milestone,
    )


def main() -> None:
    import sys

    if len(sys.argv) > 1 and sys.argv[1] == "publish":
        pp = argparse.ArgumentParser(prog="lean_layer.py publish", description=publish.__doc__)
        pp.add_argument("raw", type=Path)
        pp.add_argument("bundle", type=Path)
        pa = pp.parse_args(sys.argv[2:])
        publish(pa.raw, pa.bundle)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--store-export", default="evidence/store-export.json")
    a = ap.parse_args()
    import flag_gems.fused.fused_moe as fm
    import torch
    from mxdb.kernels.layer import MoELayer, flaggems_kernel_config
    from mxdb.kernels.live import live_fingerprint_components
    from mxdb.kernels.pipeline import MoEPipeline
    from mxdb.kernels.reference import compare, make_inputs, moe_reference
    from mxdb.kernels.timing import time_interleaved

    from mxdb.dispatcher import Dispatcher, DispatchOptions
    from mxdb.shapes import preset_shape

    dispatcher = None
    if Path(a.store_export).exists():
        from mxdb.interop.export import import_export, read_export
        from mxdb.store import Store

        exp = read_export(a.store_export)
        store = Store.open(f"sqlite:///{tempfile.mkdtemp()}/lean.sqlite")
        import_export(store, a.store_export)
        fps = list(exp.fingerprints.values())
        dispatcher = Dispatcher(store, fps[0] if fps else None, DispatchOptions(policy="strict"))
    doc: dict[str, Any] = {"fingerprint": live_fingerprint_components(), "points": []}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    for preset in ("mixtral-8x7b", "qwen3-30b-a3b"):
        fam = preset_shape(preset, 1, "bf16")
        inp = make_inputs(fam.with_tokens(1), 0, device="cuda")
        w1, w2 = inp.w1, inp.w2

        def config_for(m: int, fam: Any = fam) -> Any:
            if dispatcher is None:
                return None
            return dispatcher.dispatch(fam.with_tokens(m), "uniform").config

        layer = MoELayer(w1, w2, fam.topk, config_for)
        graphed = MoELayer(w1, w2, fam.topk, config_for, graphs=True)
        for m in TOKENS:
            try:
                shape = fam.with_tokens(m)
                i2 = make_inputs(shape, m, device="cuda")
                x, tw, ids = i2.x, i2.topk_weights, i2.topk_ids
                del i2
                ref = moe_reference(x, w1, w2, tw, ids)
                out = layer(x, tw, ids).clone()
                graphed(x, tw, ids)
                graphed(x, tw, ids)
                fg = fm.fused_experts_impl(x, w1, w2, tw, ids)
                cfg = layer.configs[m]
                same_as_fg = cfg == flaggems_kernel_config(shape)
                pipe = MoEPipeline(shape, cfg, w1, w2)
                fns = [
                    lambda: layer(x, tw, ids),
                    lambda: fm.fused_experts_impl(x, w1, w2, tw, ids),
                    lambda: graphed(x, tw, ids),
                    lambda: pipe(x, tw, ids),
                ]
                g = time_interleaved(fns[:1], reps=30, method="graph", calls_per_sample=8)
                e = time_interleaved(fns, reps=30, method="eager", calls_per_sample=8)
                rc = compare(out, ref, "bf16")
                doc["points"].append(
                    {
                        "family": preset,
                        "tokens": m,
                        "config": cfg.model_dump(),
                        "config_is_flaggems": same_as_fg,
                        "launches": layer.launches(m),
                        "record_error": layer.record_errors.get(m),
                        "correct": [rc.max_abs_err, rc.rel_err, rc.passed],
                        "identical_to_fused_experts_impl": bool(torch.equal(out, fg))
                        if same_as_fg
                        else None,
                        "graph_us": g[0],
                        "eager_us": {
                            "layer": e[0],
                            "fused_experts_impl": e[1],
                            "layer_graphs": e[2],
                            "pipeline": e[3],
                        },
                        "synced_us": {
                            "layer": synced(torch, fns[0], 30),
                            "fused_experts_impl": synced(torch, fns[1], 30),
                            "layer_graphs": synced(torch, fns[2], 30),
                        },
                        "host_us": {
                            "layer": host(torch, fns[0], 50),
                            "fused_experts_impl": host(torch, fns[1], 50),
                            "layer_graphs": host(torch, fns[2], 50),
                            "pipeline": host(torch, fns[3], 50),
                        },
                    }
                )
                p = doc["points"][-1]
                med = sorted(p["eager_us"]["layer"])[15]
                print(f"{preset} M={m}: graph {sorted(g[0])[15]:.1f} eager {med:.1f}", flush=True)
            except Exception as exc:
                doc.setdefault("errors", []).append(f"{preset} M={m}: {type(exc).__name__}: {exc}")
            atomic_json(a.out, doc)
        # where the host time goes: one profiled call sequence of the layer at M=4
        try:
            from torch.profiler import ProfilerActivity, profile

            i4 = make_inputs(fam.with_tokens(4), 4, device="cuda")
            layer(i4.x, i4.topk_weights, i4.topk_ids)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    layer(i4.x, i4.topk_weights, i4.topk_ids)
                    fm.fused_experts_impl(i4.x, w1, w2, i4.topk_weights, i4.topk_ids)
                torch.cuda.synchronize()
            doc.setdefault("profile", {})[preset] = prof.key_averages().table(
                sort_by="cpu_time_total", row_limit=25
            )
        except Exception as exc:
            doc.setdefault("errors", []).append(f"profile {preset}: {exc}")
        atomic_json(a.out, doc)
        layer = graphed = w1 = w2 = inp = None  # free the weights before the next family
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
