"""GPU measurements in one run: API facts, correctness, graph vs eager timing, compile survey.

Usage (on a GPU host with torch, triton and flag_gems 5.0.2):

    python benchmarks/gpu_survey.py OUT_DIR [--skip-survey] [--reps N]

Writes to OUT_DIR:
  api.txt        FlagGems 5.0.2 signatures and environment facts;
  layer.json     per shape: FlagGems' config, candidates' compile results, correctness vs the
                 float32 reference and vs FlagGems' fused_experts_impl, graph and eager samples;
  survey.json    the 480 distinct compilations of vLLM's 1,920-config grid for one GEMM (bf16,
                 Mixtral GEMM1: N=28672, K=4096): status, failure reason, shared memory,
                 registers, spills; plus a GROUP_SIZE_M control sample; parallel wall time.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _stats(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "median": statistics.median(s),
        "p10": s[int(0.1 * (len(s) - 1))],
        "p90": s[int(0.9 * (len(s) - 1))],
        "min": s[0],
    }


def api_facts(out: Path) -> None:
    import flag_gems
    import flag_gems.fused.fused_moe as fm
    import flag_gems.fused.moe_align_block_size
    import flag_gems.fused.moe_sum
    import torch
    import triton

    # flag_gems.fused re-exports functions under the submodules' names
    mab = sys.modules["flag_gems.fused.moe_align_block_size"]
    ms = sys.modules["flag_gems.fused.moe_sum"]
    lines = [
        f"python {sys.version}",
        f"torch {torch.__version__} cuda {torch.version.cuda}",
        f"triton {triton.__version__}",
        f"flag_gems {getattr(flag_gems, '__version__', '?')} at {flag_gems.__file__}",
        f"moe_align HAS_TLE={mab.HAS_TLE}",
        f"fused_moe_kernel args: {fm.fused_moe_kernel.arg_names}",
    ]
    for f in (
        fm.fused_experts_impl,
        fm.invoke_fused_moe_triton_kernel,
        fm.try_get_optimal_moe_config,
        fm.get_default_config,
        fm.apply_moe_activation,
        mab.moe_align_block_size,
        mab.moe_align_block_size_triton,
        ms.moe_sum,
    ):
        lines.append(f"{f.__module__}.{f.__name__}{inspect.signature(f)}")
    try:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    except Exception as exc:
        smi = repr(exc)
    (out / "api.txt").write_text("\n".join(lines) + "\n\n" + smi)
    print("\n".join(lines[:6]))


def layer_measurements(out: Path, reps: int) -> dict:
    import flag_gems.fused.fused_moe as fm
    import torch
    from mxdb.kernels.backend import GpuBackend, flaggems_config
    from mxdb.kernels.pipeline import MoEPipeline
    from mxdb.kernels.reference import compare, random_topk_ids
    from mxdb.kernels.timing import time_interleaved

    from mxdb.configs import GemmConfig, KernelConfig
    from mxdb.shapes import preset_shape

    def g(m, n, k, gm=1, w=4, s=3):
        return GemmConfig(block_m=m, block_n=n, block_k=k, group_m=gm, num_warps=w, num_stages=s)

    vllm = {  # vLLM 0.33.0's H200 table entries at M=4 (../shared/peers/vllm_h200)
        "mixtral-8x7b": g(16, 64, 64, 1, 4, 5),
        "qwen3-30b-a3b": g(16, 64, 128, 16, 4, 2),
    }
    backend = GpuBackend()
    result: dict = {"fingerprint": backend.fingerprint().components(), "shapes": []}
    try:
        result["profile"] = repr(backend.profile())
    except Exception as exc:
        result["profile"] = f"unavailable: {exc!r}"
    for preset, tokens in (("mixtral-8x7b", 4), ("qwen3-30b-a3b", 4), ("mixtral-8x7b", 64)):
        shape = preset_shape(preset, tokens, "bf16")
        base = backend.baseline_config(shape)
        alt = vllm[preset]
        cands = {
            "flaggems": base,
            "flaggems_control": base,
            "vllm_table": KernelConfig.uniform(alt),
            "split": KernelConfig(
                gemm1=alt, gemm2=base.gemm1, align_block=max(alt.block_m, base.gemm1.block_m)
            ),
            "small": KernelConfig.uniform(g(16, 32, 64, 1, 4, 2)),
        }
        names = list(cands)
        configs = list(cands.values())
        rec: dict = {
            "shape": shape.to_dict(),
            "flaggems_raw": flaggems_config(shape),
            "configs": {n: c.model_dump() for n, c in cands.items()},
        }
        t0 = time.perf_counter()
        comp = backend.compile(shape, configs)
        rec["compile_wall_s"] = time.perf_counter() - t0
        rec["compile"] = {
            n: [r.status, r.error, r.seconds] for n, r in zip(names, comp, strict=True)
        }
        ids = random_topk_ids(shape, 0).cpu().numpy()
        rec["correctness"] = {}
        for n, c in cands.items():
            corr = backend.check(shape, ids, c, seed=0)
            rec["correctness"][n] = corr.__dict__ if hasattr(corr, "__dict__") else {
                "max_abs_err": corr.max_abs_err, "rel_err": corr.rel_err,
                "threshold_abs": corr.threshold_abs, "threshold_rel": corr.threshold_rel,
                "passed": corr.passed,
            }  # fmt: skip
        for method in ("graph", "eager"):
            t0 = time.perf_counter()
            tim = backend.time(shape, ids, configs, reps=reps, seed=0, method=method)
            rec[f"time_{method}_wall_s"] = time.perf_counter() - t0
            rec[method] = {
                n: {"status": t.status, "error": t.error, **(_stats(list(t.samples_us))
                    if t.samples_us else {}), "samples_us": list(t.samples_us)}
                for n, t in zip(names, tim, strict=True)
            }  # fmt: skip
        # FlagGems as it ships (its own config lookup per call) vs our pipeline, same inputs
        w1, w2, x, tw, ids_t, ref = backend._inputs(shape, ids, 0)
        pipe = MoEPipeline(shape, base, w1, w2)
        fg_out = fm.fused_experts_impl(x, w1, w2, tw, ids_t)
        ours = pipe(x, tw, ids_t).clone()
        rec["identical_to_fused_experts_impl"] = bool(torch.equal(ours, fg_out))
        rec["flaggems_vs_reference"] = compare(fg_out, ref, shape.dtype).__dict__
        fns = [
            lambda pipe=pipe, x=x, tw=tw, ids=ids_t: pipe(x, tw, ids),
            lambda x=x, w1=w1, w2=w2, tw=tw, ids=ids_t: fm.fused_experts_impl(x, w1, w2, tw, ids),
        ]
        for method in ("graph", "eager"):
            try:
                s = time_interleaved(fns, reps=reps, method=method, calls_per_sample=8)
                rec[f"pipeline_vs_flaggems_{method}"] = {
                    "mxdb_pipeline": _stats(s[0]),
                    "fused_experts_impl": _stats(s[1]),
                }
            except Exception as exc:
                rec[f"pipeline_vs_flaggems_{method}"] = {"error": repr(exc)}
        result["shapes"].append(rec)
        gm = {n: rec["graph"][n].get("median") for n in names}
        em = {n: rec["eager"][n].get("median") for n in names}
        print(f"{preset} M={tokens}: graph {gm}\n  eager {em}")
        print(
            f"  identical={rec['identical_to_fused_experts_impl']} "
            f"corr={ {n: round(v['max_abs_err'], 6) for n, v in rec['correctness'].items()} }"
        )
        print(f"  pipeline vs flaggems graph {rec['pipeline_vs_flaggems_graph']}")
        print(f"  pipeline vs flaggems eager {rec['pipeline_vs_flaggems_eager']}")
        (out / "layer.json").write_text(json.dumps(result, indent=1, default=str))
    backend.close()
    return result


def compile_survey(out: Path) -> dict:
    import random

    from mxdb.kernels.compile import CompilePool, GemmSpec, vllm_grid_tuples
    from mxdb.kernels.live import live_fingerprint_components

    tuples = vllm_grid_tuples()
    base = {"experts": 8, "hidden": 4096, "intermediate": 14336, "topk": 2, "tokens": 64,
            "dtype": "bf16", "naive": False}  # fmt: skip

    def spec(bm, bn, bk, w, s, gm=1):
        return GemmSpec(which="gemm1", gemm=(bm, bn, bk, gm, w, s), align_block=bm, **base)

    specs = [spec(*t) for t in tuples]
    rng = random.Random(0)
    control = [(t, gm) for t in rng.sample(tuples, 32) for gm in (16, 64)]
    specs_c = [spec(*t, gm=gm) for t, gm in control]  # type: ignore[misc]
    pool = CompilePool(0)
    t0 = time.perf_counter()
    pool.run([spec(16, 64, 64, 4, 2)], timeout_s=300)  # start the workers
    t_start = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = pool.run(specs, timeout_s=300)
    wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    res_c = pool.run(specs_c, timeout_s=300)
    wall_c = time.perf_counter() - t0
    pool.close()
    rows = []
    for t, r in zip(tuples, res, strict=True):
        bm, bn, bk, w, s = t
        rows.append({"block_m": bm, "block_n": bn, "block_k": bk, "num_warps": w,
                     "num_stages": s, **r})  # fmt: skip
    by_t = {tuple(t): r for t, r in zip(tuples, res, strict=True)}
    ctrl_rows = []
    for (t, gm), r in zip(control, res_c, strict=True):
        b = by_t[tuple(t)]
        same = all(b.get(k) == r.get(k) for k in ("status", "shared", "n_regs", "n_spills"))
        ctrl_rows.append({"tuple": t, "group_m": gm, "same_as_group1": same, **r})
    counts: dict[str, int] = {}
    for r in res:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    doc = {
        "what": "vLLM grid compile survey, fused_moe_kernel GEMM1, bf16",
        "gemm": {"N": 2 * 14336, "K": 4096, "E": 8, "topk": 2, "tokens": 64},
        "environment": live_fingerprint_components(0),
        "workers": pool.workers,
        "worker_start_s": t_start,
        "wall_s": wall,
        "compile_seconds_sum": sum(r["seconds"] for r in res),
        "counts_480": counts,
        "counts_1920": {k: 4 * v for k, v in counts.items()},
        "group_m_control_wall_s": wall_c,
        "group_m_control_all_same": all(c["same_as_group1"] for c in ctrl_rows),
        "results": rows,
        "group_m_control": ctrl_rows,
    }
    (out / "survey.json").write_text(json.dumps(doc, indent=1))
    print(f"survey: {counts} in {wall:.1f}s wall with {pool.workers} workers "
          f"(sum {doc['compile_seconds_sum']:.0f}s); group_m control same: "
          f"{doc['group_m_control_all_same']}")  # fmt: skip
    return doc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--skip-survey", action="store_true")
    ap.add_argument("--skip-layer", action="store_true")
    ap.add_argument("--reps", type=int, default=40)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    api_facts(a.out)
    if not a.skip_survey:
        compile_survey(a.out)
    if not a.skip_layer:
        layer_measurements(a.out, a.reps)


if __name__ == "__main__":
    main()
