"""benchmarks/serving.py on the CPU: its summary rule and its timing loop (with a stand-in torch)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serving.py"


@pytest.fixture(scope="module")
def serving() -> Any:
    spec = importlib.util.spec_from_file_location("bench_serving", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _point(m: int, stock: float, stock2: float, hooked: float) -> dict[str, Any]:
    return {
        "family": "qwen3-30b-a3b", "tokens": m, "routing": "uniform", "path": "lean",
        "eager_us": {"stock": [stock] * 3, "stock2": [stock2] * 3, "hooked": [hooked] * 3},
    }  # fmt: skip


def test_summary(serving: Any) -> None:
    doc = {
        "points": [
            _point(1, 100.0, 101.0, 25.0),  # 4x
            _point(16, 100.0, 100.0, 100.0),  # 1x
            _point(256, 100.0, 102.0, 110.0),  # slower beyond the 2% band
            _point(512, 100.0, 100.0, 101.0),  # slower, within? band 0: beyond
            {"family": "x", "tokens": 2, "routing": "hot", "eager_us": {}},  # failed point
        ],
        "capture": {"ok": True},
    }
    s = serving.summarize(doc)
    assert s["points"] == 4 and s["small_points"] == 2
    assert s["geomean_speedup_small"] == pytest.approx(2.0)
    assert [(r["tokens"]) for r in s["slower_beyond_noise"]] == [256, 512]
    assert s["capture"] == {"ok": True}


class _Event:
    clock: ClassVar[list[float]] = [0.0]

    def __init__(self, enable_timing: bool = False) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = _Event.clock[0]

    def elapsed_time(self, end: _Event) -> float:  # milliseconds
        return end.t - self.t


class _Torch:
    class cuda:
        Event = _Event

        @staticmethod
        def synchronize() -> None:
            pass


def test_eager_interleaved(serving: Any) -> None:
    calls: list[str] = []

    def fn(name: str, ms: float) -> Any:
        def run() -> None:
            calls.append(name)
            _Event.clock[0] += ms

        return run

    out = serving.eager_interleaved(
        _Torch, {"a": fn("a", 0.002), "b": fn("b", 0.001)}, rounds=4, calls=5, seed=0
    )
    assert out["a"] == pytest.approx([2.0] * 4) and out["b"] == pytest.approx([1.0] * 4)
    assert calls.count("a") == calls.count("b") == 20


def test_help_runs_without_a_gpu() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "hooked", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "--max-tokens" in out.stdout


class _W:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


class _Cfg:
    def __init__(self, h: str) -> None:
        self.hash = h


def test_injector_slows_one_config_on_some_layers(serving: Any) -> None:
    built: list[Any] = []
    ran: list[tuple[Any, bool]] = []

    def base(w1: Any, w2: Any, topk: int, config: Any) -> Any:
        built.append((w1.ptr, config and config.hash))
        return lambda x, tw, ids, inplace: ran.append((w1.ptr, inplace)) or "out"

    inj = serving.Injector(base, 10, "slow", {1})
    a, b = _Cfg("slow"), _Cfg("fast")
    slow_run = inj(_W(1), _W(11), 8, a)
    assert inj(_W(1), _W(11), 8, a) is slow_run  # built once, shared by later hooks
    other_layer = inj(_W(2), _W(12), 8, a)
    other_cfg = inj(_W(1), _W(11), 8, b)
    fallback = inj(_W(1), _W(11), 8, None)
    assert len(built) == 4
    for run in (slow_run, other_layer, other_cfg, fallback):
        assert run(0, 0, 0, False) == "out"
    assert len(ran) == 4 and inj.count == 0
    inj.on = True
    ran.clear()
    assert slow_run(0, 0, 0, True) == "out"
    # nine extra out-of-place runs, then the real (in-place) one
    assert ran == [(1, False)] * 9 + [(1, True)] and inj.count == 1
    ran.clear()
    for run in (other_layer, other_cfg, fallback):
        run(0, 0, 0, False)
    assert len(ran) == 3 and inj.count == 1


def test_healing_summary(serving: Any) -> None:
    doc = {
        "clean": {"tokens_per_s": [100.0, 102.0, 98.0]},
        "static": {"injected_tokens_per_s": [30.0, 31.0]},
        "healing": {
            "injected_tokens_per_s": [30.0, 40.0, 97.0, 96.0, 98.0, 99.0],
            "transitions": [{"kind": "calibrated"}, {"kind": "demote"}],
        },
        "ladder": {"tokens_per_s": {"off": [100.0], "4096": [99.5], "64": [98.0], "4": [90.0]}},
    }
    s = serving.healing_summary(doc, tail=4)
    assert s["healed_tokens_per_s"] == pytest.approx(97.5)
    assert s["healed_over_clean"] == pytest.approx(0.975)
    assert s["healed_over_static"] == pytest.approx(97.5 / 30.5)
    assert s["transitions"] == ["calibrated", "demote"]
    assert s["ladder_overhead"]["4096"] == pytest.approx(0.005)
    assert s["ladder_overhead"]["4"] == pytest.approx(0.1)
