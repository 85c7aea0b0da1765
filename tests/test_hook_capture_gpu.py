"""The hook inside a CUDA graph (GPU): hooked calls captured with the routing monitor and healing
on replay to the eager result, and the hook's bookkeeping resumes after capture; FlagGems'
missing-table warning is silent where mxdb supplies the config."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from mxdb import Dispatcher
from mxdb.runtime.healing import HealingOptions
from tests.test_runtime_gpu import FP, _setup

pytestmark = pytest.mark.gpu


def _every_class(store: Any) -> None:
    """Copy the stored (uniform) entries to every routing class."""
    from mxdb.models import ROUTING_CLASSES

    entries = store.entries(status="verified")
    store.add_entries(
        [
            e.model_copy(update={"id": None, "routing_class": rc})
            for e in entries
            for rc in ROUTING_CLASSES
            if rc != e.routing_class
        ]
    )


def _warm(torch: Any, fn: Any, n: int) -> Any:
    """n eager calls on a side stream (as torch.cuda.graph's documentation asks), synchronized."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(n):
            out = fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("lean", [True, False])
@pytest.mark.parametrize("tokens", [4, 16])
def test_captured_hooked_calls_replay_the_eager_result(
    tmp_path: Path, tokens: int, lean: bool
) -> None:
    import mxdb

    torch, fm, args, store, expected = _setup(tmp_path, tokens)
    _every_class(store)  # the monitor may class this routing as anything: the same answer
    hook = mxdb.install(
        Dispatcher(store, FP),
        monitor_every=1,
        healing=HealingOptions(sample_every=1),
        lean=lean,
    )
    try:
        eager = _warm(torch, lambda: fm.fused_experts_impl(*args), 3).clone()
        before = dict(hook.stats())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fm.fused_experts_impl(*args)
        during = dict(hook.stats())
        captured.zero_()
        graph.replay()
        torch.cuda.synchronize()
        replayed = captured.clone()
        graph.replay()
        torch.cuda.synchronize()
        # outside capture the monitor copies and healing samples again
        fm.fused_experts_impl(*args)
        torch.cuda.synchronize()
        fm.fused_experts_impl(*args)
        torch.cuda.synchronize()
        after = dict(hook.stats())
    finally:
        mxdb.uninstall()
    assert torch.equal(replayed, eager)
    assert torch.equal(captured, eager)
    assert (eager.float() - expected.float()).abs().max().item() <= 1e-2
    assert during["capture_deferred"] - before["capture_deferred"] == 2
    assert during["monitor_copies"] == before["monitor_copies"]
    assert during["healing_samples"] == before["healing_samples"]
    assert after["monitor_copies"] == during["monitor_copies"] + 2
    assert after["healing_samples"] == during["healing_samples"] + 2
    assert after["fallback"] == 0
    if lean:
        assert after["lean"] == after["dispatched"] and not hook.lean_errors
    else:
        assert after["lean"] == 0


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def missing_table(self) -> int:
        n = sum(1 for m in self.lines if m.startswith("No embedded MoE config"))
        self.lines.clear()
        return n


def test_missing_table_warning_is_silent_where_mxdb_supplies_the_config(tmp_path: Path) -> None:
    import mxdb

    torch, fm, args, store, _ = _setup(tmp_path, 16)
    logger = getattr(fm, "logger", None)
    if not isinstance(logger, logging.Logger):
        logger = logging.getLogger("flag_gems")
    lines = _Lines()
    logger.addHandler(lines)
    x, w1, w2, tw, ids = args
    small = (x[:2].contiguous(), w1, w2, tw[:2].contiguous(), ids[:2].contiguous())
    try:
        mxdb.install(Dispatcher(store, FP), monitor_every=0)
        fm.fused_experts_impl(*args)  # dispatched, lean layer
        fm.fused_experts_impl(*small)  # no entry at M=2: FlagGems' choice in the lean layer
        torch.cuda.synchronize()
        assert lines.missing_table() == 0
        mxdb.install(Dispatcher(store, FP), monitor_every=0, lean=False)
        fm.fused_experts_impl(*args)  # dispatched on FlagGems' path
        torch.cuda.synchronize()
        assert lines.missing_table() == 0
        fm.fused_experts_impl(*small)  # FlagGems' own fallback: its warning stays
        torch.cuda.synchronize()
        control = lines.missing_table()
    finally:
        mxdb.uninstall()
        logger.removeHandler(lines)
    if control == 0:
        pytest.skip("FlagGems logged no missing-table warning on this device (it has a table)")
