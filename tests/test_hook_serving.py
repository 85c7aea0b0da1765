"""The hook in a serving engine (CPU, stand-in FlagGems): CUDA-graph capture, the lean layer for
every call, and FlagGems' missing-table warning.  The dispatcher, store and healer are real."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

import mxdb
from mxdb import Dispatcher, KernelConfig
from mxdb.runtime.healing import HealingOptions
from mxdb.runtime.hook import MISSING_TABLE_PREFIX, MissingTableFilter
from mxdb.store import Store
from tests import test_runtime_hook as hook_tests
from tests.test_dispatcher import H200
from tests.test_runtime_hook import CFG_A, CFG_B, G128, SHAPE, M, VirtualClock, _args, _entry

# the stand-in FlagGems package and the store of the hook's own tests
fm = hook_tests.fm
store = hook_tests.store


class CaptureClock(VirtualClock):
    """The virtual clock, a capture switch, and a log of every event/copy operation."""

    def __init__(self, fm: Any) -> None:
        super().__init__(fm)
        self.capture = False
        self.ops: list[tuple[str, bool]] = []

    def capturing(self) -> bool:
        return self.capture

    def _op(self, name: str) -> None:
        self.ops.append((name, self.capture))

    def mark(self) -> Any:
        self._op("mark")
        return super().mark()

    def ready(self, mark: Any) -> bool:
        self._op("ready")
        return True

    def start_copy(self, ids: Any) -> Any:
        self._op("start_copy")
        return super().start_copy(ids)

    def copy_ready(self, handle: Any) -> bool:
        self._op("copy_ready")
        return True


def test_capture_touches_no_event_and_bakes_the_current_decision(fm: Any, store: Store) -> None:
    store.add_entries(
        [_entry(CFG_A, speedup=1.3, median_us=10.0), _entry(CFG_B, speedup=1.1, median_us=12.0)]
    )
    d = Dispatcher(store, H200)
    clock = CaptureClock(fm)
    opts = HealingOptions(sample_every=1, window=3, degrade_samples=2, probe_every=4)
    hook = mxdb.install(d, monitor_every=1, healing=opts, clock=clock)
    fm.COST.update({128: 10.0, 64: 12.0})
    for _ in range(6):  # eager warm-up: monitor and healing at work
        fm.fused_experts_impl(*_args())
    assert {op for op, _ in clock.ops} == {"mark", "ready", "start_copy", "copy_ready"}
    st = hook.stats()
    samples, copies = st["healing_samples"], st["monitor_copies"]
    clock.capture = True
    clock.ops.clear()
    captured = [fm.fused_experts_impl(*_args())["config"] for _ in range(5)]
    assert clock.ops == []  # nothing queried, recorded or copied while capturing
    st = hook.stats()
    assert (st["healing_samples"], st["monitor_copies"]) == (samples, copies)
    assert st["capture_deferred"] == 10  # the monitor's and the healer's turn, per call
    # the decision at capture time is the one that runs (and would be baked into the graph)
    assert captured == [d.dispatch(SHAPE, "uniform").config.gemm1.to_triton()] * 5  # type: ignore[union-attr]
    clock.capture = False
    fm.fused_experts_impl(*_args())
    assert {op for op, cap in clock.ops} == {"mark", "ready", "start_copy", "copy_ready"}
    assert all(not cap for _, cap in clock.ops)
    st = hook.stats()
    assert st["healing_samples"] == samples + 1 and st["monitor_copies"] == copies + 1
    # healing still works after a capture: A slows down 10x, the healer moves to B
    fm.COST[128] = 100.0
    for _ in range(30):
        fm.fused_experts_impl(*_args())
    assert d.dispatch(SHAPE, "uniform").config == CFG_B


class CudaArray(np.ndarray):
    """A host array that says it lives on the GPU: takes the hook's lean path on CPU."""

    is_cuda = True


def _cuda_args(tokens: int = M) -> tuple[Any, ...]:
    x, w1, w2, tw, ids = _args(tokens)
    return (x.view(CudaArray), w1, w2, tw, ids)


def test_lean_layer_for_dispatched_and_fallback_calls(fm: Any, store: Store) -> None:
    store.add_entries([_entry(CFG_A)])
    built: list[KernelConfig | None] = []
    ran: list[tuple[KernelConfig | None, bool]] = []

    def factory(w1: Any, w2: Any, topk: int, config: KernelConfig | None) -> Any:
        built.append(config)
        return lambda x, tw, ids, inplace: ran.append((config, inplace)) or "lean-out"

    hook = mxdb.install(Dispatcher(store, H200), monitor_every=0, pipeline_factory=factory)
    assert fm.fused_experts_impl(*_cuda_args()) == "lean-out"  # dispatched: CFG_A
    fm.inplace_fused_experts(*_cuda_args())
    assert fm.fused_experts_impl(*_cuda_args(tokens=64)) == "lean-out"  # fallback: FlagGems'
    assert fm.fused_experts_impl(*_cuda_args(tokens=64)) == "lean-out"
    assert built == [CFG_A, None]  # one layer per (weights, config), built once
    assert ran == [(CFG_A, False), (CFG_A, True), (None, False), (None, False)]
    assert fm.CALLS == []  # FlagGems' path never ran
    # beyond lean_max_tokens, and on host tensors, FlagGems' path as before
    assert fm.fused_experts_impl(*_cuda_args(tokens=512))["config"]["flaggems"]
    assert fm.fused_experts_impl(*_args())["config"] == G128.to_triton()
    st = hook.stats()
    assert (st["lean"], st["lean_fallback"], st["dispatched"], st["fallback"]) == (2, 2, 3, 3)
    # lean=False keeps FlagGems' own path for every call
    hook = mxdb.install(
        Dispatcher(store, H200), monitor_every=0, pipeline_factory=factory, lean=False
    )
    assert fm.fused_experts_impl(*_cuda_args())["config"] == G128.to_triton()
    assert fm.fused_experts_impl(*_cuda_args(tokens=64))["config"]["flaggems"]
    assert hook.stats()["lean"] == 0 and len(built) == 2


def test_lean_layer_that_cannot_be_built_falls_back_once(fm: Any, store: Store) -> None:
    store.add_entries([_entry(CFG_A)])
    tries: list[Any] = []

    def factory(w1: Any, w2: Any, topk: int, config: KernelConfig | None) -> Any:
        tries.append(config)
        raise RuntimeError("no triton here")

    hook = mxdb.install(Dispatcher(store, H200), monitor_every=0, pipeline_factory=factory)
    for _ in range(3):
        assert fm.fused_experts_impl(*_cuda_args())["config"] == G128.to_triton()
    assert tries == [CFG_A]
    assert hook.stats()["lean_unavailable"] == 1
    assert list(hook.lean_errors.values()) == ["RuntimeError: no triton here"]


def test_lean_layer_whose_first_call_fails_falls_back_once(fm: Any, store: Store) -> None:
    store.add_entries([_entry(CFG_A)])
    calls: list[Any] = []

    def factory(w1: Any, w2: Any, topk: int, config: KernelConfig | None) -> Any:
        def run(x: Any, tw: Any, ids: Any, inplace: bool) -> Any:
            calls.append(config)
            raise RuntimeError("workspace build failed")

        return run

    hook = mxdb.install(Dispatcher(store, H200), monitor_every=0, pipeline_factory=factory)
    for _ in range(3):
        assert fm.fused_experts_impl(*_cuda_args())["config"] == G128.to_triton()
        assert fm.fused_experts_impl(*_cuda_args(tokens=64))["config"]["flaggems"]
    assert calls == [CFG_A, None]
    st = hook.stats()
    assert (st["lean"], st["lean_fallback"], st["lean_unavailable"]) == (0, 0, 2)
    assert st["dispatched"] == 3 and st["fallback"] == 3


def _record(msg: str, level: int = logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord("flag_gems.x", level, __file__, 1, msg, ("NVIDIA_H200",), None)


def test_missing_table_filter_is_exact() -> None:
    on = MissingTableFilter(lambda: True)
    off = MissingTableFilter(lambda: False)
    plural = _record("No embedded MoE configs for device %s. Will use default config.")
    key = _record("No embedded MoE config for device=%s, key=%s. Will use default config.")
    assert not on.filter(plural) and not on.filter(key) and on.dropped == 2
    assert off.filter(plural)  # only while the hook supplies the config
    assert on.filter(_record("Using embedded MoE config for device=%s", logging.INFO))
    assert on.filter(_record("something else about %s"))
    assert on.filter(_record(plural.msg, logging.ERROR))  # type: ignore[arg-type]
    assert plural.getMessage().startswith(MISSING_TABLE_PREFIX)


def test_missing_table_warning_silenced_only_where_mxdb_supplies_the_config(
    fm: Any, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    # FlagGems' layout: a child of the "flag_gems" logger, warning on every table lookup
    fm.logger = logging.getLogger("flag_gems").getChild("flag_gems.fused.fused_moe")
    impl = fm.fused_experts_impl

    # and a logger elsewhere in FlagGems, not a module attribute
    other = logging.getLogger("flag_gems.runtime.backend._nvidia.fused")

    def fused_experts_impl(*args: Any, **kwargs: Any) -> Any:
        fm.logger.warning(
            "No embedded MoE configs for device %s. Will use default config.", "NVIDIA_H200"
        )
        other.warning("No embedded MoE config for device=%s, key=%s.", "NVIDIA_H200", "8,32")
        return impl(*args, **kwargs)

    fm.fused_experts_impl = fused_experts_impl
    store.add_entries([_entry(CFG_A)])

    def warned() -> int:
        n = sum(1 for r in caplog.records if r.getMessage().startswith(MISSING_TABLE_PREFIX))
        caplog.clear()
        return n

    caplog.set_level(logging.WARNING)
    hook = mxdb.install(Dispatcher(store, H200), monitor_every=0, lean=False)
    fm.fused_experts_impl(*_args())  # dispatched: mxdb supplies the config
    assert warned() == 0
    fm.fused_experts_impl(*_args(tokens=512))  # fallback on FlagGems' path: its own choice
    assert warned() == 2
    assert hook.log_filter.dropped == 2
    mxdb.uninstall()  # the filter goes with the hook
    assert hook.log_filter not in fm.logger.filters and hook.log_filter not in other.filters
    fm.fused_experts_impl(*_args())
    assert warned() == 2
