"""The tuning benchmark on recorded per-GEMM sweeps: develop the search on a CPU.

The backend (``SweepReplay``: a recorded sweep served as a backend, its model and noise) is
:mod:`mxdb.tune.replay`; this script simulates the benchmark's reuse runs on it.

    python benchmarks/sweep_replay.py --sweeps evidence/h200-tuning-cost --seeds 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

from mxdb.configs import KernelConfig
from mxdb.routing import expert_counts
from mxdb.tune.replay import SweepReplay, SweepTable

# -- simulation of the benchmark ----------------------------------------------------------------


def simulate(
    bundle: Path,
    point_index: int,
    seed: int,
    options: dict[str, Any],
    budget_fraction: float,
    final_reps: int = 30,
    search_seed: int | None = None,
) -> dict[str, Any]:
    """One simulated reuse run of one point: mxdb's search, then the final interleaved timing."""
    sys.path.insert(0, str(Path(__file__).parent))
    import bench_tuning as bt

    from mxdb.evidence import stats

    points = bt._source_points(bundle)
    sp = points[point_index]
    pt = sp["point"]
    shape, ids, _ = bt._point_traces(*pt, sp["dtype"], sp["seed"])  # type: ignore[call-arg]
    table = SweepTable.load(bundle, sp["id"])
    backend = SweepReplay(table, shape, ids, seed=seed)
    backend.warm_up()
    common = {"dtype": sp["dtype"], "seed": sp["seed"], "point": pt}
    budget = budget_fraction * sp["exhaustive_gpu_seconds"]
    task = {**common, "options": options, "budget_s": budget}
    if search_seed is not None:
        task["search_seed"] = search_seed
    mx = bt._mxdb(bt.Metered(backend), task)
    b1 = KernelConfig.parse(sp["sweeps"]["gemm1"]["best"])
    b2 = KernelConfig.parse(sp["sweeps"]["gemm2"]["best"])
    from mxdb.tune.space import joint

    lineup = [b1, b2, joint(b1.gemm1, b2.gemm2), KernelConfig.parse(mx["winner"])]
    final = bt._final(
        bt.Metered(backend),
        {
            **common,
            "lineup": [c.model_dump_json() for c in lineup],
            "labels": bt.FINAL_LABELS,
            "final_reps": final_reps,
        },
    )
    meds = [stats.median(s) for s in final["samples_us"]]
    ex_best = min(meds[:3])
    answer = mx["comparison"]["answer"]
    ans_med = meds[3] if answer == "winner" else meds[4]
    counts = expert_counts(np.asarray(ids), shape.experts)
    return {
        "point": sp["id"],
        "seed": seed,
        "quality_ratio": ans_med / ex_best,
        "winner_quality_ratio": meds[3] / ex_best,
        "gpu_time_fraction": mx["gpu_seconds"] / sp["exhaustive_gpu_seconds"],
        "answer": answer,
        "reason": mx["comparison"]["reason"],
        "winner": KernelConfig.parse(mx["winner"]).short(),
        "stages": mx["stages"],
        "budget_exhausted": mx["budget_exhausted"],
        "true_ratio": backend.model_us(KernelConfig.parse(mx["winner"]), counts)
        / min(backend.model_us(c, counts) for c in lineup[:3]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--sweeps", type=Path, default=Path("evidence/h200-tuning-cost"))
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--points", default="0,1,2")
    ap.add_argument("--options", default=None, help="JSON overriding the benchmark's options")
    ap.add_argument("--budget-fraction", type=float, default=None)
    ap.add_argument("--json", type=Path, default=None, help="write every run here")
    ap.add_argument(
        "--vary-search",
        action="store_true",
        help="also vary the search's own seed (its random draws), not only the noise",
    )
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    import bench_tuning as bt

    from mxdb.tune.workload import SearchOptions

    options = {**SearchOptions().model_dump(exclude={"budget_minutes"}), **bt.BENCH_OPTIONS}
    if args.options:
        options.update(json.loads(args.options))
    frac = args.budget_fraction if args.budget_fraction is not None else bt.BUDGET_FRACTION
    runs = []
    ok_all = True
    for i in (int(x) for x in args.points.split(",")):
        res = [
            simulate(args.sweeps, i, s, options, frac, search_seed=s if args.vary_search else None)
            for s in range(args.seeds)
        ]
        runs.extend(res)
        q = sorted(r["quality_ratio"] for r in res)
        f = sorted(r["gpu_time_fraction"] for r in res)
        met = sum(1 for r in res if r["quality_ratio"] <= 1.01 and r["gpu_time_fraction"] <= 0.10)
        ok_all &= met == len(res)
        print(
            f"p{i}: quality median {statistics.median(q):.4f} worst {q[-1]:.4f}; "
            f"GPU fraction median {statistics.median(f):.4f} worst {f[-1]:.4f}; "
            f"answer=winner {sum(r['answer'] == 'winner' for r in res)}/{len(res)}; "
            f"target met {met}/{len(res)}"
        )
        if args.verbose:
            for r in res:
                print(
                    f"   seed {r['seed']}: q {r['quality_ratio']:.4f} (winner "
                    f"{r['winner_quality_ratio']:.4f}, model {r['true_ratio']:.4f}) "
                    f"f {r['gpu_time_fraction']:.4f} {r['answer']} {r['winner']} "
                    f"{r['reason']}"
                )
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1, default=str))
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
