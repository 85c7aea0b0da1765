"""What the layer implementations gave, from the replayed comparisons of tune bundles.

At every tuning point the tuner times its finalists under each implementation, interleaved on
the point's own trace (``mxdb.tune.search``, stage 4).  This reads those runs (audited raw
samples, no GPU needed) and prints, per point, the fastest config of the implementations
``--over`` (default ``flaggems``) over the fastest of ``--impl`` (default ``fused_act``): how
much that implementation adds to config choice among the others.

    python benchmarks/impl_gain.py evidence/h200-peers-*-20261201T06* \
        --out benchmarks/results/impl_gain.json
    python benchmarks/impl_gain.py evidence/h200-peers-decode-*-20261201T1101* \
        --impl fused_slice --over flaggems,fused_act --out benchmarks/results/impl_gain_slice.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from mxdb.configs import KernelConfig
from mxdb.fileio import atomic_write_json

#: Roles of a replayed comparison's arms that ran a config to completion.
ROLES = ("candidate", "peer", "baseline", "control")


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def best_by_impl(bundles: list[Path]) -> dict[tuple[int, int, str], dict[str, float]]:
    """``(experts, tokens, point) -> {impl: fastest median us}`` over the bundles' replay runs."""
    out: dict[tuple[int, int, str], dict[str, float]] = defaultdict(dict)
    for bundle in bundles:
        for f in sorted((bundle / "runs").glob("*.json")):
            r = json.loads(f.read_text())
            if r.get("comparison") != "replay" or r.get("status") != "ok":
                continue
            med = (r.get("timing") or {}).get("median_us")
            if r.get("role") not in ROLES or med is None:
                continue
            impl = KernelConfig.parse(r["config"]).impl
            key = (r["shape"]["experts"], r["shape"]["tokens"], r["point"])
            out[key][impl] = min(out[key].get(impl, math.inf), float(med))
    return out


def summarize(
    best: dict[tuple[int, int, str], dict[str, float]],
    impl: str = "fused_act",
    over: tuple[str, ...] = ("flaggems",),
) -> dict[str, Any]:
    rows: list[dict[str, Any]] = [
        {
            "experts": e,
            "tokens": m,
            "point": p,
            "ratio": min(d[o] for o in over if o in d) / d[impl],
        }
        for (e, m, p), d in sorted(best.items())
        if impl in d and any(o in d for o in over)
    ]
    if not rows:
        raise SystemExit(f"no point timed {impl} and any of {', '.join(over)} in these bundles")
    by_family: dict[str, Any] = {}
    for e in sorted({r["experts"] for r in rows}):
        rs = [r for r in rows if r["experts"] == e]
        by_m: dict[int, list[float]] = defaultdict(list)
        for r in rs:
            by_m[r["tokens"]].append(r["ratio"])
        by_family[f"E{e}"] = {
            "points": len(rs),
            "geomean": _geomean([r["ratio"] for r in rs]),
            "min": min(r["ratio"] for r in rs),
            "max": max(r["ratio"] for r in rs),
            "by_tokens": {str(m): _geomean(v) for m, v in sorted(by_m.items())},
        }
    return {
        "what": f"per tuning point: fastest {' or '.join(over)} config / fastest {impl} config, "
        "replay medians of one interleaved comparison on the point's trace",
        "points": len(rows),
        "geomean": _geomean([r["ratio"] for r in rows]),
        "by_family": by_family,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundles", nargs="+", type=Path, help="tune bundles (evidence/...)")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    ap.add_argument("--impl", default="fused_act", help="the implementation whose gain to show")
    ap.add_argument("--over", default="flaggems", help="comma-separated implementations it beats")
    args = ap.parse_args(argv)
    over = tuple(x for x in args.over.split(",") if x)
    res = summarize(best_by_impl(args.bundles), args.impl, over)
    print(
        f"{res['points']} points: fastest {' or '.join(over)} / fastest {args.impl}, "
        f"geomean {res['geomean']:.4f}"
    )
    for fam, f in res["by_family"].items():
        print(
            f"  {fam}: {f['points']} points, geomean {f['geomean']:.4f} "
            f"({f['min']:.3f}-{f['max']:.3f}); by M: "
            + " ".join(f"{m}:{v:.3f}" for m, v in f["by_tokens"].items())
        )
    if args.out:
        atomic_write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
