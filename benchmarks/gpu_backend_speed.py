"""How fast GpuBackend measures: compile and time many configs of vLLM's grid for one shape.

Usage: python benchmarks/gpu_backend_speed.py OUT_DIR [--configs N] [--reps R]

For each shape: the grid's configs that the resource proxy (mxdb.resources.check, live profile)
lets through, the first N in a seeded shuffle plus FlagGems' own config twice (control pair);
wall time of ``compile`` (parallel), ``time`` (graph, R samples each) and ``time`` (eager).
Writes OUT_DIR/backend_speed.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--configs", type=int, default=120)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)

    from mxdb.kernels.backend import GpuBackend

    from mxdb import resources
    from mxdb.configs import KernelConfig
    from mxdb.routing_gen import generate
    from mxdb.shapes import preset_shape

    backend = GpuBackend()
    profile = backend.profile()
    doc: dict = {"fingerprint": backend.fingerprint().components(), "runs": []}
    for preset, tokens in (("qwen3-30b-a3b", 4), ("mixtral-8x7b", 4), ("qwen3-30b-a3b", 256)):
        shape = preset_shape(preset, tokens, "bf16")
        grid = [KernelConfig.uniform(g) for g in resources.vllm_grid()]
        fits = [c for c in grid if resources.check(c, shape, profile).fits]
        random.Random(0).shuffle(fits)
        base = backend.baseline_config(shape)
        configs = [base, base, *fits[: a.configs]]
        ids = generate("uniform", tokens, shape.experts, shape.topk, seed=0)
        t0 = time.perf_counter()
        comp = backend.compile(shape, configs)
        t_compile = time.perf_counter() - t0
        ok = [c for c, r in zip(configs, comp, strict=True) if r.status == "ok"]
        run: dict = {
            "shape": shape.to_dict(),
            "grid": len(grid),
            "proxy_fits": len(fits),
            "configs": len(configs),
            "compile_status": {
                s: sum(r.status == s for r in comp) for s in {r.status for r in comp}
            },
            "compile_wall_s": t_compile,
        }
        for method in ("graph", "eager"):
            t0 = time.perf_counter()
            tim = backend.time(shape, ids, ok, reps=a.reps, seed=0, method=method)
            run[f"time_{method}_wall_s"] = time.perf_counter() - t0
            med = [statistics.median(t.samples_us) if t.samples_us else None for t in tim]
            run[f"{method}_status"] = {
                s: sum(t.status == s for t in tim) for s in {t.status for t in tim}
            }
            good = [(m, c.short()) for m, c in zip(med, ok, strict=True) if m is not None]
            good.sort()
            run[f"{method}_best"] = good[:5]
            run[f"{method}_baseline_median_us"] = med[:2]
        doc["runs"].append(run)
        print(json.dumps({k: v for k, v in run.items() if "best" not in k}))
        print("  best graph:", run["graph_best"][:3])
        (a.out / "backend_speed.json").write_text(json.dumps(doc, indent=1))
    backend.close()


if __name__ == "__main__":
    main()
