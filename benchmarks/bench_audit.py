"""Benchmark: audit one evidence bundle of 10,000 runs (target: at most 5 s on 2 cores).

Generates a synthetic bundle with the real writer in a temporary folder, audits it several
times (each a full audit: hashes, schemas, recomputation) and records the median.

    python benchmarks/bench_audit.py [--runs 10000] [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mxdb.audit import audit_paths
from mxdb.evidence.files import atomic_write
from mxdb.evidence.synthetic import synthetic_bundle

TARGET_S = 5.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "bench_audit.json"
    )
    args = parser.parse_args(argv)
    runs_per_group = 80
    groups = max(1, args.runs // runs_per_group)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        root = synthetic_bundle(
            Path(tmp) / "bundle", groups=groups, runs_per_group=runs_per_group, seed=0
        )
        gen_s = time.perf_counter() - t0
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            result = audit_paths([root])
            times.append(time.perf_counter() - t0)
            if not result.ok:
                print(f"unexpected findings: {result.findings[:3]}", file=sys.stderr)
                return 1
        n_runs = result.bundles[0].runs
    med = statistics.median(times)
    record = {
        "benchmark": "audit",
        "runs": n_runs,
        "repeats": args.repeats,
        "median_s": round(med, 4),
        "min_s": round(min(times), 4),
        "max_s": round(max(times), 4),
        "target_s": TARGET_S,
        "ok": med <= TARGET_S,
        "generate_s": round(gen_s, 2),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
    }
    atomic_write(args.out, (json.dumps(record, indent=2) + "\n").encode())
    print(
        f"audit of {n_runs} runs: median {med:.3f} s over {args.repeats} repeats "
        f"(min {min(times):.3f}, max {max(times):.3f}; target {TARGET_S} s) -> {args.out}"
    )
    return 0 if med <= TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
