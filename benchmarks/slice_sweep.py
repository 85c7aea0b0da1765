"""The ``fused_slice`` tile sweep that chose its search menu (``mxdb.tune.space.SLICE_TILES``).

Usage (GPU host): python benchmarks/slice_sweep.py run OUT.json
Usage (anywhere): python benchmarks/slice_sweep.py summary benchmarks/results/h200_slice_sweep.json

``run``: for Mixtral-8x7B and Qwen3-30B-A3B (bf16) at M in {1, 2, 4, 8, 16, 32} on uniform
routing (4 instances up to M = 8, 2 above; seed ``1000 M + i``), times 81 ``fused_slice`` tiles
(block_m 16; slice 32/64/128, hidden step 64/128/256, output chunk 64/128/256; warps and stages
4/3, 8/3, 4/4) next to FlagGems' choice, vLLM's H200 row (nearest M) and the store's verified
and parity configs at the key (``evidence/store-export.json`` as it was then), interleaved in 15
CUDA-graph rounds of random order through ``GpuBackend.time``; the fastest tile is checked
against the float32 reference.  ``summary``: the tiles' geomean distance from each point's
best, and the best of the menu against the best of all 81 at every point.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

FAMILIES = {"mixtral": (8, 4096, 14336, 2), "qwen3": (128, 2048, 768, 8)}
TOKENS = (1, 2, 4, 8, 16, 32)


def run(out: Path, vllm_dir: str) -> None:
    from mxdb.kernels.backend import GpuBackend

    from mxdb.configs import GemmConfig, KernelConfig
    from mxdb.shapes import MoEShape

    be = GpuBackend()
    store = json.loads(Path("evidence/store-export.json").read_text())["entries"]
    res: dict[str, Any] = {"points": []}
    grid = [
        KernelConfig.fused_slice(
            block_m=16, block_i=bi, block_k=bk, block_h=bh, num_warps=w, num_stages=s
        )
        for bi in (32, 64, 128)
        for bk in (64, 128, 256)
        for bh in (64, 128, 256)
        for (w, s) in ((4, 3), (8, 3), (4, 4))
    ]
    t0 = time.time()
    for name, (e, h, i, k) in FAMILIES.items():
        vt = json.loads(Path(glob.glob(f"{vllm_dir}/E={e},N={i}*")[0]).read_text())
        for m in TOKENS:
            shape = MoEShape(e, h, i, k, m, "bf16")
            base = be.baseline_config(shape)
            near = min((int(x) for x in vt), key=lambda x: abs(x - m))
            vcfg = KernelConfig.uniform(GemmConfig.from_triton(dict(vt[str(near)])))
            fam = f"E{e}-H{h}-I{i}-k{k}"
            ents = [
                KernelConfig.parse(x["config"])
                for x in store
                if x["family"] == fam and x["tokens"] == m and x["status"] in ("verified", "parity")
            ]
            cr = be.compile(shape, grid)
            ok = [c for c, r in zip(grid, cr, strict=True) if r.status == "ok"]
            bad = {r.status for r in cr if r.status != "ok"}
            configs = [*dict.fromkeys([base, vcfg, *ents, *ok])]
            for inst in range(4 if m <= 8 else 2):
                seed = 1000 * m + inst
                rng = np.random.default_rng(seed)
                ids = np.stack([rng.choice(e, size=k, replace=False) for _ in range(m)])
                ids = ids.astype(np.int32)
                tm = be.time(shape, ids, configs, reps=15, seed=7, order_seed=seed)
                med = {
                    c.hash: float(np.median(t.samples_us)) if t.status == "ok" and t.samples_us
                    else None
                    for c, t in zip(configs, tm, strict=True)
                }  # fmt: skip
                timed = [c for c in ok if med[c.hash]]
                best = min(timed, key=lambda c: med[c.hash] or 0.0, default=None)
                chk = be.check(shape, ids, best, seed=7) if best is not None else None
                row = {
                    "family": name, "M": m, "inst": inst,
                    "touched": len(set(ids.ravel().tolist())),
                    "base_us": med[base.hash], "vllm_us": med[vcfg.hash],
                    "store_us": min((med[c.hash] or 1e30 for c in ents), default=None),
                    "slice_us": med[best.hash] if best else None,
                    "slice_cfg": best.model_dump() if best else None,
                    "slice_all": {c.short(): med[c.hash] for c in ok},
                    "check": None if chk is None else [chk.max_abs_err, chk.rel_err, chk.passed],
                    "compile_failed": sorted(bad),
                }  # fmt: skip
                res["points"].append(row)
                print(name, m, inst, row["touched"], row["base_us"], row["vllm_us"],
                      row["store_us"], row["slice_us"], flush=True)  # fmt: skip
            print("elapsed", time.time() - t0, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))


def summary(raw: Path) -> dict[str, Any]:
    from mxdb.tune.space import SLICE_TILES

    points = json.loads(raw.read_text())["points"]
    menu = {
        f"M16/N{bi}/K{bk}/G1/w{w}/s{st} | M16/N{bh}/K{bi}/G1/w{w}/s{st} | align16 | fused_slice"
        for bi, bk, bh, w, st in SLICE_TILES
    }
    worst = 1.0
    for p in points:
        times = {c: t for c, t in p["slice_all"].items() if t}
        best_all = min(times.values())
        best_menu = min(t for c, t in times.items() if c in menu)
        worst = max(worst, best_menu / best_all)
    per_point_best = [
        min(t for t in p["slice_all"].values() if t) / p["store_us"]
        for p in points
        if p["store_us"]
    ]
    return {
        "points": len(points),
        "menu_tiles": len(menu & set(points[0]["slice_all"])),
        "menu_best_over_all_best_worst": worst,
        "best_slice_over_store_best_geomean": math.exp(
            sum(math.log(x) for x in per_point_best) / len(per_point_best)
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="time the tiles on the GPU")
    r.add_argument("out", type=Path)
    r.add_argument("--vllm-dir", default=".dev/carry/vllm")
    s = sub.add_parser("summary", help="the menu against the whole sweep")
    s.add_argument("raw", type=Path)
    a = ap.parse_args()
    if a.cmd == "run":
        run(a.out, a.vllm_dir)
    else:
        json.dump(summary(a.raw), sys.stdout, indent=1)
        print()


if __name__ == "__main__":
    main()
