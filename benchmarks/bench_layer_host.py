"""Host cost of the lean MoE layer's per-call Python path, with fake tensors and launchers.

Usage: python benchmarks/bench_layer_host.py [--calls N] [--out benchmarks/results/layer_host.json]

Runs without torch or a GPU: :class:`mxdb.kernels.lean.LeanLayer` and
:class:`~mxdb.kernels.lean.LaunchPlan` (the exact code a GPU call runs) drive fake launchers that
take the same argument lists as the real ones (Triton's compiled launcher: grid, stream,
function, flags, then the kernel's arguments).  Two plans: a sparse decode batch (4 launches:
GEMM1, activation, GEMM2, sum) and an aligned batch (9 launches: memset, 4 alignment stages,
GEMM1, activation, GEMM2, sum).  Records layer calls per second and microseconds per call
(best of 5 repeats); the JSON is written atomically.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

from mxdb.kernels.lean import OUT, TOPK_IDS, TOPK_WEIGHTS, LaunchPlan, LeanLayer, Step, X

from mxdb.fileio import atomic_write_text


class FakeTensor:
    """Stands in for a tensor: the layer's per-call path reads only ``shape``."""

    __slots__ = ("shape",)

    def __init__(self, *shape: int) -> None:
        self.shape = shape


def fake_launch(*args: Any) -> None:
    """Stands in for a Triton launcher (its C call costs about 2-3 us on the GPU host)."""


def fake_memset() -> None:
    """Stands in for a torch memset of the alignment counts."""


def _launch(n_kernel_args: int, binds: tuple[tuple[int, int], ...]) -> Step:
    head = [1, 1, 1, None, object(), False, False, None, None]
    args = head + [0] * (4 + n_kernel_args)  # packed metadata, launch metadata, two hooks
    return (fake_launch, args, tuple((len(head) + 4 + p, s) for p, s in binds), 3)


def plan(aligned: bool, out: FakeTensor) -> LaunchPlan:
    """The step list of the real plan, with fake launchers (argument counts as on the GPU)."""
    steps: list[Step] = []
    if aligned:
        steps.append((fake_memset, [], (), -1))
        steps += [
            _launch(11, ((0, TOPK_IDS),)),
            _launch(2, ()),
            _launch(6, ()),
            _launch(9, ((0, TOPK_IDS),)),
        ]
    gemm1 = ((0, X), (6, TOPK_WEIGHTS)) + (() if aligned else ((8, TOPK_IDS),))
    gemm2 = ((6, TOPK_WEIGHTS),) + (() if aligned else ((8, TOPK_IDS),))
    steps += [
        _launch(45, gemm1),
        _launch(12, ()),
        _launch(45, gemm2),
        _launch(10, ((1, OUT),)),
    ]
    return LaunchPlan(steps, out, stream_fn=lambda: 0)


def bench(tokens: int, aligned: bool, calls: int) -> dict[str, Any]:
    out = FakeTensor(tokens, 2048)

    def build(m: int, cfg: Any, x: Any, tw: Any, ids: Any) -> LaunchPlan:
        return plan(aligned, out)

    layer = LeanLayer(build, config_for=lambda m: {"tokens": m})
    x, tw, ids = FakeTensor(tokens, 2048), FakeTensor(tokens, 8), FakeTensor(tokens, 8)
    layer(x, tw, ids)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            layer(x, tw, ids)
        best = min(best, (time.perf_counter_ns() - t0) / calls)
    ws = layer.workspace(tokens)
    assert isinstance(ws, LaunchPlan)
    return {
        "tokens": tokens,
        "aligned": aligned,
        "launches": ws.launches,
        "us_per_call": best / 1000.0,
        "calls_per_s": 1e9 / best,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/layer_host.json"))
    a = ap.parse_args()
    rows = [bench(1, False, a.calls), bench(16, True, a.calls)]
    doc = {
        "benchmark": "layer_host",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "calls": a.calls,
        "results": rows,
    }
    for r in rows:
        print(
            f"M={r['tokens']:>3} launches={r['launches']}: {r['us_per_call']:.2f} us/call, "
            f"{r['calls_per_s']:,.0f} calls/s"
        )
    atomic_write_text(a.out, json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
