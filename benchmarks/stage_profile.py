"""Where the fused MoE layer's GPU time goes: each stage of the pipeline timed on its own.

Usage (GPU host): python benchmarks/stage_profile.py run OUT.json [--deadline-s S]
                  [--dispatch STORE_EXPORT.json]
Usage (anywhere): python benchmarks/stage_profile.py publish OUT.json evidence/h200-stages

For Mixtral-8x7B, Qwen3-30B-A3B and DeepSeek-V2-Lite (bf16) at M in {1, 4, 16, 64, 256, 1024}
under uniform, Zipf(1.2) and hot-expert (half the tokens to expert 0) routing, with FlagGems'
own config, or with ``--dispatch`` the config mxdb dispatches for the point's routing class from
that store export (FlagGems' config where it falls back; a family the store has no entries for
is profiled with it too): the layer's stages (align, GEMM1, activation, GEMM2, sum, and
fused_slice's one kernel; which of them an implementation has: ``mxdb.evidence.stages``) are
each captured in a CUDA graph of their own launches, next to a
graph of the whole layer, and timed interleaved in a random order per round (the buffers hold
a real call's data, so every stage reads what it reads in the layer).  The device-to-device
copy bandwidth and a streaming-read bandwidth (a float32 sum over 2 GiB of bf16) are measured
in the same process, and the dense bf16 matmul rate (8192^3, torch) for the compute floor.

``publish`` writes the bundle: ``fingerprint.json``, ``stages.json`` (``mxdb.stages``: raw
samples, routing generators and every figure, recomputed by ``mxdb audit``) and
``report/stages.md``.
"""

# ruff: noqa: B023  (the timed lambdas run before their loop variables change)
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from mxdb.fileio import atomic_write_text

FAMILIES = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v2-lite")
TOKENS = (1, 4, 16, 64, 256, 1024)
#: routing kind -> mxdb.routing_gen parameters
ROUTINGS: dict[str, dict[str, Any]] = {
    "uniform": {},
    "zipf": {"s": 1.2},
    "hot": {"fraction": 0.5, "hot_expert": 0},
}
ROUNDS = 10


def bandwidths(torch: Any, reps: int = 20) -> tuple[list[float], list[float], list[float]]:
    """Copy (read + write bytes) and streaming-read bandwidth samples, bytes per second, and
    dense bf16 matmul rate samples (8192^3), FLOP per second."""
    from mxdb.kernels.timing import copy_bandwidth_samples, rate_samples, read_bandwidth_samples

    copy = copy_bandwidth_samples(reps)
    read = read_bandwidth_samples(reps)
    s = 8192
    x = torch.randn(s, s, dtype=torch.bfloat16, device="cuda")
    y = torch.randn(s, s, dtype=torch.bfloat16, device="cuda")
    mm = rate_samples(lambda: x @ y, 2 * s**3, reps=reps)
    return copy, read, mm


def stage_groups(impl: str, steps: list[Any]) -> dict[str, list[Any]]:
    """The pipeline's launches (``MoEPipeline.steps``, in call order) by stage: the alignment's
    launches come first, then the implementation's own (``mxdb.evidence.stages.IMPL_STAGES``)."""
    from mxdb.evidence.stages import IMPL_STAGES

    own = IMPL_STAGES[impl]
    n = len(steps) - len(own)
    return {"align": steps[:n], **{s: [steps[n + i]] for i, s in enumerate(own)}}


def dispatcher(export: str, doc: dict[str, Any], live: str) -> Any:
    """``(shape, ids, fallback config) -> (config, reason)``: mxdb's answer for the class of
    the routing, from ``export`` imported into a throwaway store, under the live fingerprint
    ``live`` when the export has it (else its first; ``doc`` records which)."""
    import tempfile

    from mxdb.dispatcher import Dispatcher, DispatchOptions
    from mxdb.interop.export import import_export, read_export
    from mxdb.routing import classify, features
    from mxdb.store import Store

    fps = list(read_export(export).fingerprints.values())
    store = Store.open(f"sqlite:///{tempfile.mkdtemp()}/stages.sqlite")
    import_export(store, export)
    fp = next((f for f in fps if f.hash == live), fps[0] if fps else None)
    doc["dispatch_fingerprint"] = fp.hash if fp is not None else None
    doc["dispatch_fingerprint_is_live"] = fp is not None and fp.hash == live
    d = Dispatcher(store, fp, DispatchOptions(policy="strict"))

    def choose(shape: Any, ids: Any, fallback: Any) -> tuple[Any, str]:
        ans = d.dispatch(shape, classify(features(ids, shape.experts)))
        return (ans.config if ans.config is not None else fallback), str(ans.reason)

    return choose


def run(a: argparse.Namespace) -> None:
    import numpy as np
    import torch
    from mxdb.kernels.backend import GpuBackend
    from mxdb.kernels.compile import specs_for
    from mxdb.kernels.layer import flaggems_kernel_config
    from mxdb.kernels.live import live_fingerprint_components
    from mxdb.kernels.pipeline import MoEPipeline
    from mxdb.kernels.reference import make_activations, make_weights
    from mxdb.kernels.timing import time_interleaved

    from mxdb.routing_gen import generate
    from mxdb.shapes import preset_shape

    t0 = time.monotonic()
    copy, read, mm = bandwidths(torch)
    doc: dict[str, Any] = {
        "fingerprint": live_fingerprint_components(),
        "copy_samples": copy,
        "read_samples": read,
        "matmul_samples": mm,
        "config_source": "dispatch" if a.dispatch else "flaggems",
        "points": [],
        "errors": [],
    }
    backend = GpuBackend()
    choose = dispatcher(a.dispatch, doc, backend.fingerprint().hash) if a.dispatch else None
    for fi, preset in enumerate(FAMILIES):
        fam = preset_shape(preset, 1, "bf16")
        w1, w2 = make_weights(fam, fi)
        # (M, routing kind) -> (seed, ids, config, dispatch reason)
        plan: dict[tuple[int, str], tuple[int, Any, Any, str | None]] = {}
        for m in TOKENS:
            shape = fam.with_tokens(m)
            for kind, params in ROUTINGS.items():
                seed = 1000 * fi + m
                ids_np = generate(kind, m, shape.experts, shape.topk, seed, **params)
                cfg, why = flaggems_kernel_config(shape), None
                if choose is not None:
                    cfg, why = choose(shape, ids_np, cfg)
                plan[(m, kind)] = (seed, ids_np, cfg, why)
        backend.compile_raw([s for (m, _), (_, _, cfg, _) in plan.items()
                             for s in specs_for(fam.with_tokens(m), cfg)])  # fmt: skip
        for (m, kind), (seed, ids_np, cfg, why) in plan.items():
            shape = fam.with_tokens(m)
            params = ROUTINGS[kind]
            if time.monotonic() - t0 > a.deadline_s:
                doc["errors"].append(f"{preset} M={m} {kind}: not timed (deadline)")
                continue
            ids_t = torch.from_numpy(np.ascontiguousarray(ids_np, dtype=np.int32)).cuda()
            x, tw, ids = make_activations(shape, seed, ids_t, "cuda")
            pipe = MoEPipeline(shape, cfg, w1, w2)
            pipe(x, tw, ids)
            steps = [thunk for _, thunk in pipe.steps(x, tw, ids, pipe.out)]
            groups = stage_groups(cfg.impl, steps)
            names = [n for n, g in groups.items() if g] + ["layer"]
            fns: list[Any] = [(lambda g=groups[n]: [f() for f in g]) for n in names[:-1]]
            fns.append(lambda: pipe(x, tw, ids))
            calls = 8 if m <= 64 else 2
            g = time_interleaved(fns, reps=ROUNDS, method="graph", calls_per_sample=calls,
                                 warmup=2, order_seed=seed)  # fmt: skip
            samples = dict(zip(names, g, strict=True))
            samples.setdefault("align", [])
            doc["points"].append({
                "family": preset, "tokens": m, "config": cfg.model_dump(),
                "routing": {"kind": kind, "seed": seed, "params": params},
                "samples": samples, "dispatch_reason": why,
            })  # fmt: skip
            print(f"{preset} M={m} {kind} ({cfg.impl}): layer "
                  f"{np.median(samples['layer']):.1f} us at {time.monotonic() - t0:.0f}s",
                  flush=True)  # fmt: skip
        del w1, w2
        torch.cuda.empty_cache()
    backend.close()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(a.out, json.dumps(doc))


def publish(raw_path: Path, bundle: Path) -> Path:
    """Write the stage-profile bundle from the raw JSON (every figure computed by mxdb)."""
    from mxdb.configs import KernelConfig
    from mxdb.evidence.stages import REPORT_FILE, STAGES_FILE, StagesDoc, build_stages, render
    from mxdb.evidence.writer import publish_bundle
    from mxdb.models import Fingerprint
    from mxdb.shapes import preset_shape

    raw = json.loads(raw_path.read_text())
    fp = Fingerprint(**raw["fingerprint"])
    points = []
    for p in raw["points"]:
        cfg = KernelConfig.model_validate(p["config"])
        points.append({
            "family": p["family"], "tokens": p["tokens"],
            "shape": preset_shape(p["family"], p["tokens"], "bf16").to_dict(),
            "routing": p["routing"], "config": p["config"], "config_hash": cfg.hash,
            "samples": p["samples"], "dispatch_reason": p.get("dispatch_reason"),
        })  # fmt: skip
    doc = build_stages(
        points,
        milestone=bundle.name,
        fingerprint_hash=fp.hash,
        copy_samples=raw["copy_samples"],
        read_samples=raw["read_samples"],
        matmul_samples=raw["matmul_samples"],
        errors=raw.get("errors", []),
        config_source=raw.get("config_source", "flaggems"),
    )
    doc = StagesDoc.model_validate(doc).to_json_dict()
    return publish_bundle(
        bundle,
        fingerprint=fp,
        files={STAGES_FILE: doc, REPORT_FILE: render(doc)},
        milestone=bundle.name,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="time the stages on this GPU (writes the raw JSON)")
    r.add_argument("out", type=Path)
    r.add_argument("--deadline-s", type=float, default=240.0)
    r.add_argument(
        "--dispatch",
        metavar="STORE_EXPORT",
        help="profile the config mxdb dispatches from this store export (mxdb export --format "
        "mxdb) for each point's routing class, instead of FlagGems' own",
    )
    p = sub.add_parser("publish", help="write the evidence bundle from the raw JSON")
    p.add_argument("raw", type=Path)
    p.add_argument("bundle", type=Path)
    a = ap.parse_args()
    if a.cmd == "run":
        run(a)
    else:
        print(publish(a.raw, a.bundle))


if __name__ == "__main__":
    main()
