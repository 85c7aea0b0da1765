"""The self-healing state machine, driven with injected timings (no GPU)."""

from __future__ import annotations

import pytest

from mxdb.configs import GemmConfig, KernelConfig
from mxdb.decision import EXACT, Decision
from mxdb.errors import UsageError
from mxdb.runtime.healing import Healer, HealingOptions


def _decision(block_n: int, entry_id: int) -> Decision:
    cfg = KernelConfig.uniform(
        GemmConfig(block_m=16, block_n=block_n, block_k=64, num_warps=4, num_stages=3)
    )
    return Decision(
        config=cfg, level=EXACT, confidence=1.0, reason="exact_match", entry_id=entry_id
    )


A, B, C = _decision(64, 1), _decision(128, 2), _decision(256, 3)
KEY = ("shape", "uniform")
OPTS = HealingOptions(
    window=3, degrade_ratio=1.5, degrade_samples=3, recover_ratio=1.2, recover_samples=2,
    probe_every=4, cooldown=5,
)  # fmt: skip


def _healer(opts: HealingOptions = OPTS, recorded: tuple[float | None, ...] = (10.0, 12.0, 14.0)):
    changes: list[tuple[int | None, bool]] = []
    h = Healer(opts, on_change=lambda k, d, orig: changes.append((d.entry_id, orig)))
    h.track(KEY, [A, B, C], recorded)
    return h, changes


def _feed(h: Healer, us: float, n: int) -> None:
    """n sampled calls, each running what the healer plans, timed at us (probes too)."""
    for _ in range(n):
        i, _d = h.plan(KEY)
        h.record(KEY, i, us)


def test_healthy_choice_stays() -> None:
    h, changes = _healer()
    _feed(h, 11.0, 50)
    assert h.active(KEY) == 0 and changes == []


def test_single_spikes_do_not_demote() -> None:
    h, changes = _healer()
    for i in range(60):
        h.record(KEY, 0, 100.0 if i % 4 == 0 else 10.0)  # 1 in 4 samples slow: median fine
    assert h.active(KEY) == 0 and changes == []


def test_degraded_choice_demoted_after_k_consecutive_strikes() -> None:
    h, changes = _healer()
    _feed(h, 10.0, 3)
    h.record(KEY, 0, 100.0)  # window [10, 10, 100]: median 10, no strike
    h.record(KEY, 0, 100.0)  # median 100: strike 1
    assert h.active(KEY) == 0
    h.record(KEY, 0, 100.0)  # strike 2
    assert h.active(KEY) == 0
    h.record(KEY, 0, 100.0)  # strike 3: demote to the next-best
    assert h.active(KEY) == 1
    assert changes == [(2, False)]
    t = h.transitions[-1]
    assert (t.kind, t.from_index, t.to_index) == ("demote", 0, 1) and t.ratio == 10.0


def test_strikes_reset_by_a_good_median() -> None:
    h, _ = _healer()
    for us in (100, 100, 100, 10, 10, 10, 100, 100):  # never 3 bad medians in a row
        h.record(KEY, 0, us)
    assert h.state(KEY)["strikes"] < 3 and h.active(KEY) == 0


def test_probes_original_and_recovers() -> None:
    h, changes = _healer()
    _feed(h, 100.0, 3)  # demoted after 3 strikes (first sample judged at len 2)
    while h.active(KEY) == 0:
        _feed(h, 100.0, 1)
    assert h.active(KEY) == 1
    # The alternative runs fine; the original is still slow: probes fail.
    plans = []
    for _ in range(16):
        i, _d = h.plan(KEY)
        plans.append(i)
        h.record(KEY, i, 100.0 if i == 0 else 12.0)
    assert plans.count(0) == 4  # every probe_every-th sampled call probes the original
    assert h.active(KEY) == 1
    # The original recovers: two good probes in a row bring it back.
    for _ in range(8):
        i, _d = h.plan(KEY)
        h.record(KEY, i, 10.5 if i == 0 else 12.0)
    assert h.active(KEY) == 0
    assert changes == [(2, False), (1, True)]
    assert [t.kind for t in h.transitions] == ["demote", "recover"]


def test_all_degraded_returns_to_original_with_cooldown() -> None:
    h, changes = _healer()
    for _ in range(40):  # a global slowdown: everything 5x slower, probes too
        i, _d = h.plan(KEY)
        h.record(KEY, i, 5 * (10.0, 12.0, 14.0)[i])
        if any(t.kind == "exhausted" for t in h.transitions):
            break
    kinds = [t.kind for t in h.transitions]
    assert kinds == ["demote", "demote", "exhausted"]
    assert h.active(KEY) == 0 and changes[-1] == (1, True)
    st = h.state(KEY)
    assert st["demoted"] == [] and st["cooldown_left"] == 5
    _feed(h, 50.0, 5)  # no moves while cooling down
    assert h.active(KEY) == 0 and h.state(KEY)["cooldown_left"] == 0


def test_calibrates_baseline_when_none_recorded() -> None:
    h, changes = _healer(recorded=(None, None, None))
    _feed(h, 20.0, 3)  # the first window calibrates: baseline 20
    assert h.state(KEY)["baselines_us"][0] == 20.0
    assert h.transitions[-1].kind == "calibrated"
    _feed(h, 25.0, 10)  # 1.25x: fine
    assert h.active(KEY) == 0
    _feed(h, 40.0, 5)  # 2x: demoted
    assert h.active(KEY) == 1 and changes == [(2, False)]


def test_recorded_mode_never_judges_without_baseline() -> None:
    h, changes = _healer(HealingOptions(baseline="recorded", window=3), recorded=(None,))
    _feed(h, 1000.0, 30)
    assert h.active(KEY) == 0 and changes == []


def test_stale_samples_of_other_candidates_are_ignored() -> None:
    h, _ = _healer()
    for _ in range(10):
        h.record(KEY, 2, 1000.0)  # not active, not demoted: no move
    h.record(KEY, 7, 1.0)  # out of range
    h.record(("other",), 0, 1.0)  # untracked key
    assert h.active(KEY) == 0 and h.state(KEY)["demoted"] == []


def test_options_validated() -> None:
    with pytest.raises(UsageError, match="degrade_ratio"):
        HealingOptions(degrade_ratio=1.0)
    with pytest.raises(UsageError, match="flap"):
        HealingOptions(degrade_ratio=1.3, recover_ratio=1.4)
    with pytest.raises(UsageError, match="window"):
        HealingOptions(window=0)
    with pytest.raises(UsageError, match="baseline"):
        HealingOptions(baseline="median")
    with pytest.raises(UsageError, match="non-fallback"):
        Healer().track(KEY, [])
