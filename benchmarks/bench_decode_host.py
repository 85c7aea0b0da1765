"""Host cost of the decode ops' recorded-launch path, with CPU tensors and fake launchers.

Usage: python benchmarks/bench_decode_host.py [--calls N] [--out benchmarks/results/decode_host.json]

Runs without triton or a GPU: :class:`mxdb.kernels.decode_launch.DecodeOps` (the exact code a GPU
call runs: exact key, table lookup, ``torch.empty`` for the outputs, the argument writes, the
launcher call) over fake Triton kernels whose first call goes through a fake launcher object
(recorded as on the GPU: Triton 3.9's layout, kernel arguments as one tuple) and whose compiled
launch function does nothing (the real one's C call costs a few microseconds on the GPU host).
Tensors are CPU torch tensors at Qwen3-0.6B decode shapes (batch 8, hidden 1024, 16/8 heads of
128, intermediate 3072, attention span 300).  Records, per op, calls per second and
microseconds per call (best of 5 repeats) of the whole op, and of the replay alone; every call
must take the recorded path (checked).  The JSON is written atomically.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from mxdb.kernels.decode_launch import RECORDED, DecodeOps

from mxdb.fileio import atomic_write_text


def c_launch(*args: Any) -> None:
    """Stands in for Triton's compiled launch function."""


class FakeLauncher:
    """Triton 3.9's launcher object: ``launch`` gets the kernel arguments as one tuple."""

    global_scratch_size = 0
    profile_scratch_size = 0

    def __init__(self) -> None:
        self.launch = c_launch

    def __call__(self, gx: int, gy: int, gz: int, stream: int, fn: Any, packed: Any,
                 meta: Any, enter: Any, exit_: Any, *args: Any) -> None:  # fmt: skip
        self.launch(gx, gy, gz, stream, fn, False, False, packed, meta, enter, exit_, None,
                    None, "annotations", "signature", args)  # fmt: skip


class FakeKernel:
    """``kernel[grid](*args, **kw)`` as Triton's JIT path: one launcher call."""

    def __init__(self) -> None:
        self.launcher = FakeLauncher()

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        def run(*args: Any, **kw: Any) -> Any:
            consts = [v for k, v in kw.items() if k != "num_warps"]
            self.launcher(grid[0], 1, 1, 0, "function", "packed", None, None, None, *args, *consts)
            return self

        return run


def cases() -> dict[str, tuple[Any, ...]]:
    h = torch.bfloat16
    b, hid, hq, hk, d, inter, span = 8, 1024, 16, 8, 128, 3072, 300
    x = torch.randn(b, 1, hid).to(h)
    q = torch.randn(b, 1, hq, d).to(h).transpose(1, 2)
    k = torch.randn(b, 1, hk, d).to(h).transpose(1, 2)
    cos = torch.randn(b, 1, d).to(h)
    gate, up = torch.randn(b, 1, 2 * inter).to(h).chunk(2, -1)
    mask = torch.zeros(b, 1, 1, span + 16, dtype=h)
    return {
        "rms_norm": (x, torch.ones(hid, dtype=h), 1e-6),
        "add_rms_norm": (x, x.clone(), torch.ones(hid, dtype=h), 1e-6),
        "rope": (q, k, cos, cos.clone()),
        "masked_softmax": (torch.randn(b, hq, 1, span).to(h), mask, 0.088),
        "swiglu": (gate, up),
    }


def _best(fn: Callable[[], Any], calls: int) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / calls)
    return best


def bench(calls: int) -> list[dict[str, Any]]:
    kernels = {n: FakeKernel() for n in ("rms_norm", "rope", "masked_softmax", "swiglu")}
    ops = DecodeOps(kernels, lambda: FakeLauncher, lambda dev: lambda: 0)
    rows = []
    for op, args in cases().items():
        fn = getattr(ops, op)
        fn(*args)  # the first call: JIT path, recorded
        entry = next(iter(ops.tables[op].values()))
        replay = entry[0]
        assert replay.mode == RECORDED, ops.paths()
        whole = _best(lambda fn=fn, args=args: fn(*args), calls)  # type: ignore[misc]
        out = fn(*args)
        outs = list(out) if isinstance(out, tuple) else [out]
        if op in ("rms_norm", "add_rms_norm", "masked_softmax"):  # scalar last
            vals = (*args[:-1], *outs, args[-1])
        else:
            vals = (*args, *outs)
        alone = _best(lambda r=replay, v=vals: r(v), calls)  # type: ignore[misc]
        rows.append(
            {
                "op": op,
                "path": replay.mode,
                "us_per_call": whole / 1000.0,
                "calls_per_s": 1e9 / whole,
                "replay_us_per_call": alone / 1000.0,
            }
        )
    assert len(ops.tables["rms_norm"]) == 1 and ops.paths()["path"] == RECORDED
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/decode_host.json"))
    a = ap.parse_args()
    rows = bench(a.calls)
    doc = {
        "benchmark": "decode_host",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "calls": a.calls,
        "results": rows,
    }
    for r in rows:
        print(
            f"{r['op']:>15} [{r['path']}]: {r['us_per_call']:.2f} us/call "
            f"({r['calls_per_s']:,.0f} calls/s), replay alone {r['replay_us_per_call']:.2f} us"
        )
    atomic_write_text(a.out, json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
