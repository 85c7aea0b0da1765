"""The FlagGems hook on CPU, against a stand-in flag_gems package with fused_moe's layout.

The stand-in's ``fused_experts_impl`` looks up ``try_get_optimal_moe_config`` as a module
global per call, as FlagGems 5.0.2 does, and reports the config it ran with.  The dispatcher,
store, healer and hook are the real ones.
"""

from __future__ import annotations

import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mxdb
from mxdb import Dispatcher, KernelConfig, MoEShape
from mxdb.configs import GemmConfig
from mxdb.models import Entry
from mxdb.runtime.healing import HealingOptions
from mxdb.runtime.hook import HostClock
from mxdb.store import Store
from tests.test_dispatcher import H200

FUSED_MOE = textwrap.dedent(
    """
    import functools

    CALLS = []
    CLOCK = [0.0]
    COST = {}   # BLOCK_SIZE_N -> virtual microseconds per call

    def try_get_optimal_moe_config(w1_shape, w2_shape, top_k, dtype, M, E, block_shape=None):
        return {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32,
                "GROUP_SIZE_M": 8, "num_warps": 4, "num_stages": 3, "flaggems": True}

    def fused_experts_impl(hidden_states, w1, w2, topk_weights, topk_ids, inplace=False,
                           activation="silu", apply_router_weight_on_input=False,
                           use_fp8_w8a8=False, global_num_experts=-1, expert_map=None,
                           block_shape=None):
        get_config_func = functools.partial(
            try_get_optimal_moe_config, w1.shape, w2.shape, topk_ids.shape[1], None,
            block_shape=block_shape, E=w1.shape[0])
        config = get_config_func(hidden_states.shape[0])
        CALLS.append(config)
        CLOCK[0] += COST.get(config["BLOCK_SIZE_N"], 1.0)
        return {"config": config, "out": hidden_states * 2}

    def inplace_fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, **kw):
        fused_experts_impl(hidden_states, w1, w2, topk_weights, topk_ids, inplace=True, **kw)

    def outplace_fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, **kw):
        return fused_experts_impl(hidden_states, w1, w2, topk_weights, topk_ids, **kw)
    """
)

E, H, I, K, M = 8, 64, 32, 2, 4  # noqa: E741
SHAPE = MoEShape(E, H, I, K, M, "fp16")
G64 = GemmConfig(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=3)
G128 = GemmConfig(block_m=16, block_n=128, block_k=64, num_warps=4, num_stages=3)
CFG_A = KernelConfig.uniform(G128)
CFG_B = KernelConfig.uniform(G64)
CFG_SPLIT = KernelConfig(gemm1=G128, gemm2=G64, align_block=16)


class VirtualClock(HostClock):
    """Reads the stand-in's virtual clock: each call advances it by its config's cost."""

    def __init__(self, fm: Any) -> None:
        self.fm = fm

    def mark(self) -> Any:
        return self.fm.CLOCK[0]

    def elapsed_us(self, start: Any, end: Any) -> float:
        return float(end - start)


@pytest.fixture()
def fm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    root = tmp_path / "site"
    pkg = root / "flag_gems" / "fused"
    pkg.mkdir(parents=True)
    (root / "flag_gems" / "__init__.py").write_text("from flag_gems import fused\n")
    (pkg / "__init__.py").write_text(
        "from flag_gems.fused.fused_moe import fused_experts_impl, try_get_optimal_moe_config\n"
    )
    (pkg / "fused_moe.py").write_text(FUSED_MOE)
    monkeypatch.syspath_prepend(str(root))
    import flag_gems.fused.fused_moe as mod

    yield mod
    mxdb.uninstall()
    for name in [n for n in sys.modules if n == "flag_gems" or n.startswith("flag_gems.")]:
        del sys.modules[name]


def _entry(config: KernelConfig, *, tokens: int = M, routing: str = "uniform",
           speedup: float = 1.2, median_us: float | None = None) -> Entry:  # fmt: skip
    s = SHAPE.with_tokens(tokens)
    return Entry(
        dtype=s.dtype, family=s.family, dims=s.dims(), tokens=tokens, routing_class=routing,
        config=config.model_dump(), config_hash=config.hash, fingerprint_hash=H200.hash,
        status="verified", source="tune", speedup=speedup, noise_band=0.01, median_us=median_us,
    )  # fmt: skip


@pytest.fixture()
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(f"sqlite:///{tmp_path / 'mxdb.sqlite'}")
    s.put_fingerprint(H200)
    yield s
    s.close()


def _args(tokens: int = M, ids: Any = None) -> tuple[Any, ...]:
    rng = np.random.default_rng(0)
    x = np.ones((tokens, H), dtype=np.float16)
    if ids is None:
        ids = np.stack([rng.choice(E, K, replace=False) for _ in range(tokens)])
    return x, W1, W2, np.full((tokens, K), 0.5, dtype=np.float32), ids


W1 = np.zeros((E, 2 * I, H), dtype=np.float16)
W2 = np.zeros((E, H, I), dtype=np.float16)


def test_install_dispatches_and_uninstall_restores_identity(fm: Any, store: Store) -> None:
    import flag_gems.fused as fused

    orig_impl, orig_cfg = fm.fused_experts_impl, fm.try_get_optimal_moe_config
    store.add_entries([_entry(CFG_A)])
    hook = mxdb.install(Dispatcher(store, H200), monitor_every=0)
    assert fm.fused_experts_impl is not orig_impl and fused.fused_experts_impl is not orig_impl
    assert fm.fused_experts_impl.__wrapped__ is orig_impl
    res = fm.outplace_fused_experts(*_args())
    assert res["config"] == G128.to_triton()
    fm.inplace_fused_experts(*_args())
    assert fm.CALLS[-1] == G128.to_triton()
    # A call that does not pass through fused_experts_impl gets FlagGems' own choice.
    assert fm.try_get_optimal_moe_config((E, 2 * I, H), (E, H, I), K, None, M, E)["flaggems"]
    assert hook.stats()["dispatched"] == 2
    assert mxdb.uninstall() is True
    assert fm.fused_experts_impl is orig_impl and fm.try_get_optimal_moe_config is orig_cfg
    assert fused.fused_experts_impl is orig_impl
    assert fused.try_get_optimal_moe_config is orig_cfg
    assert mxdb.uninstall() is False
    assert fm.outplace_fused_experts(*_args())["config"]["flaggems"]


def test_fallback_and_unsupported_calls_keep_flaggems_choice(fm: Any, store: Store) -> None:
    store.add_entries([_entry(CFG_A)])
    hook = mxdb.install(Dispatcher(store, H200), monitor_every=0)
    far = fm.fused_experts_impl(*_args(tokens=512))  # beyond the token neighbourhood
    assert far["config"]["flaggems"]
    quant = fm.fused_experts_impl(*_args(), use_fp8_w8a8=True)
    assert quant["config"]["flaggems"]
    ep = fm.fused_experts_impl(*_args(), expert_map=np.arange(E))
    assert ep["config"]["flaggems"]
    st = hook.stats()
    assert (st["fallback"], st["unsupported"], st["dispatched"]) == (1, 2, 0)


def test_reinstall_replaces_and_still_restores(fm: Any, store: Store) -> None:
    orig = fm.fused_experts_impl
    d = Dispatcher(store, H200)
    mxdb.install(d, monitor_every=0)
    mxdb.install(d, monitor_every=0)
    assert fm.fused_experts_impl.__wrapped__ is orig
    mxdb.uninstall()
    assert fm.fused_experts_impl is orig


def test_split_config_modes(fm: Any, store: Store) -> None:
    store.add_entries([_entry(CFG_SPLIT)])
    ran: list[tuple[KernelConfig, bool]] = []

    def factory(w1: Any, w2: Any, topk: int, config: KernelConfig) -> Any:
        assert w1 is W1 and w2 is W2 and topk == K
        return lambda x, tw, ids, inplace: ran.append((config, inplace)) or "pipeline-out"

    hook = mxdb.install(Dispatcher(store, H200), monitor_every=0, pipeline_factory=factory)
    assert fm.fused_experts_impl(*_args()) == "pipeline-out"
    fm.inplace_fused_experts(*_args())
    assert ran == [(CFG_SPLIT, False), (CFG_SPLIT, True)]
    assert hook.stats()["split_pipeline"] == 2 and fm.CALLS == []
    hook = mxdb.install(Dispatcher(store, H200), monitor_every=0, split="gemm1")
    assert fm.fused_experts_impl(*_args())["config"] == G128.to_triton()
    assert hook.stats()["split_gemm1"] == 1
    hook = mxdb.install(Dispatcher(store, H200), monitor_every=0, split="fallback")
    assert fm.fused_experts_impl(*_args())["config"]["flaggems"]
    assert hook.stats()["split_fallback"] == 1


def test_an_entry_of_another_implementation_runs_mxdbs_pipeline(fm: Any, store: Store) -> None:
    fused = CFG_A.with_impl("fused_act")
    store.add_entries([_entry(fused)])
    ran: list[KernelConfig] = []

    def factory(w1: Any, w2: Any, topk: int, config: KernelConfig) -> Any:
        return lambda x, tw, ids, inplace: ran.append(config) or "pipeline-out"

    hook = mxdb.install(Dispatcher(store, H200), monitor_every=0, pipeline_factory=factory)
    assert fm.fused_experts_impl(*_args()) == "pipeline-out"
    # FlagGems' own path would run the tiles with its own kernels: never taken
    assert ran == [fused] and fm.CALLS == []
    assert hook.stats()["split_pipeline"] == 1


def test_routing_monitor_updates_the_layer_class(fm: Any, store: Store) -> None:
    store.add_entries([_entry(CFG_A, routing="uniform"), _entry(CFG_B, routing="hot")])
    hook = mxdb.install(Dispatcher(store, H200), monitor_every=4)
    m = 256
    store.add_entries(
        [_entry(CFG_A, tokens=m, routing="uniform"), _entry(CFG_B, tokens=m, routing="hot")]
    )
    rng = np.random.default_rng(1)
    hot = np.stack([[0, *rng.choice(np.arange(1, E), K - 1, replace=False)] for _ in range(m)])
    seen = [fm.fused_experts_impl(*_args(tokens=m, ids=hot))["config"] for _ in range(6)]
    # Calls 1-4 dispatch as uniform; the 4th copies the ids, the 5th classifies them as hot.
    assert seen[:4] == [G128.to_triton()] * 4
    assert seen[4:] == [G64.to_triton()] * 2
    assert hook.routing_classes() == {id(W1): "hot"}
    assert hook.stats()["monitor_copies"] == 1 and hook.stats()["class_updates"] == 1


def test_concurrent_calls_from_threads(fm: Any, store: Store) -> None:
    store.add_entries([_entry(CFG_A), _entry(CFG_A, tokens=8)])
    hook = mxdb.install(
        Dispatcher(store, H200), monitor_every=8, healing=HealingOptions(sample_every=4)
    )
    errors: list[BaseException] = []
    results: list[dict[str, Any]] = []

    def worker(tokens: int) -> None:
        try:
            for _ in range(200):
                results.append(fm.fused_experts_impl(*_args(tokens=tokens)))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(4 if i % 2 else 8,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(results) == 1200
    assert all(r["config"] == G128.to_triton() for r in results)
    # The per-thread context never leaks: a bare config call still gets FlagGems' choice.
    assert fm.try_get_optimal_moe_config((E, 2 * I, H), (E, H, I), K, None, M, E)["flaggems"]
    assert hook.stats()["calls"] >= 1100  # counters are not locked: a few may be lost


def test_self_healing_moves_off_a_slowed_config_and_back(fm: Any, store: Store) -> None:
    store.add_entries(
        [_entry(CFG_A, speedup=1.3, median_us=10.0), _entry(CFG_B, speedup=1.1, median_us=12.0)]
    )
    d = Dispatcher(store, H200)
    opts = HealingOptions(sample_every=2, window=3, degrade_samples=2, probe_every=4)
    hook = mxdb.install(d, monitor_every=0, healing=opts, clock=VirtualClock(fm))
    fm.COST.update({128: 10.0, 64: 12.0})
    for _ in range(20):
        fm.fused_experts_impl(*_args())
    assert d.dispatch(SHAPE, "uniform").config == CFG_A
    fm.COST[128] = 100.0  # config A slows down 10x
    for _ in range(40):
        fm.fused_experts_impl(*_args())
    assert d.dispatch(SHAPE, "uniform").config == CFG_B
    assert fm.CALLS[-1]["BLOCK_SIZE_N"] in (64, 128)
    fm.COST[128] = 10.0  # recovered: probes bring it back
    for _ in range(60):
        fm.fused_experts_impl(*_args())
    assert d.dispatch(SHAPE, "uniform").config == CFG_A
    kinds = [t["kind"] for t in hook.stats()["transitions"]]
    assert kinds == ["demote", "recover"]
    assert d.overrides() == {}
    assert hook.stats()["healing_probes"] >= 2


def test_import_mxdb_does_not_import_the_hook() -> None:
    import subprocess

    code = "import sys, mxdb; print('mxdb.runtime.hook' in sys.modules, 'flag_gems' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_self_healing_falls_back_to_flaggems_choice_when_the_only_config_degrades(
    fm: Any, store: Store
) -> None:
    store.add_entries([_entry(CFG_A, speedup=1.3, median_us=10.0)])
    d = Dispatcher(store, H200)
    assert [a.config for a in d.alternatives(SHAPE, "uniform")] == [CFG_A]
    opts = HealingOptions(sample_every=2, window=3, degrade_samples=2, probe_every=4)
    asked: list[MoEShape] = []

    def safe(shape: MoEShape) -> KernelConfig:
        asked.append(shape)
        return CFG_B  # stands for FlagGems' own choice at this shape

    hook = mxdb.install(d, monitor_every=0, healing=opts, clock=VirtualClock(fm), safe_config=safe)
    fm.COST.update({128: 10.0, 64: 12.0})
    for _ in range(20):
        fm.fused_experts_impl(*_args())
    assert d.dispatch(SHAPE, "uniform").config == CFG_A
    assert asked == [SHAPE]
    fm.COST[128] = 100.0  # the only dispatched config slows down 10x
    for _ in range(40):
        fm.fused_experts_impl(*_args())
    moved = d.dispatch(SHAPE, "uniform")
    assert moved.config == CFG_B
    assert moved.reason == "healing_fallback"
    assert fm.CALLS[-1]["BLOCK_SIZE_N"] in (64, 128)
    kinds = [t["kind"] for t in hook.stats()["transitions"]]
    assert kinds[0] == "demote" and "exhausted" not in kinds
    # the fallback had no recorded median: its baseline was calibrated in situ
    assert set(kinds[1:]) <= {"calibrated"}


def test_healing_adds_no_safe_candidate_already_offered(fm: Any, store: Store) -> None:
    store.add_entries(
        [_entry(CFG_A, speedup=1.3, median_us=10.0), _entry(CFG_B, speedup=1.1, median_us=12.0)]
    )
    d = Dispatcher(store, H200)
    opts = HealingOptions(sample_every=2, window=3, degrade_samples=2, probe_every=4)
    hook = mxdb.install(
        d, monitor_every=0, healing=opts, clock=VirtualClock(fm), safe_config=lambda s: CFG_B
    )
    fm.COST.update({128: 10.0, 64: 12.0})
    for _ in range(4):
        fm.fused_experts_impl(*_args())
    assert hook.healer is not None
    key = next(iter(hook.healer._keys))
    assert [c.config for c in hook.healer._keys[key].candidates] == [CFG_A, CFG_B]


def test_install_hook_alternates_hooks_and_keeps_their_counts(fm: Any, store: Store) -> None:
    from mxdb.runtime.hook import Hook, install_hook, installed

    store.add_entries([_entry(CFG_A)])
    d = Dispatcher(store, H200)
    every4 = Hook(d, monitor_every=0, healing=HealingOptions(sample_every=4),
                  clock=VirtualClock(fm))  # fmt: skip
    plain = Hook(d, monitor_every=0, clock=VirtualClock(fm))
    for _ in range(3):  # three rounds of 3 calls each through each hook
        assert install_hook(every4) is every4 and installed() is every4
        for _ in range(3):
            fm.fused_experts_impl(*_args())
        install_hook(plain)
        for _ in range(3):
            fm.fused_experts_impl(*_args())
    assert every4.stats()["calls"] == plain.stats()["calls"] == 9
    assert every4.stats()["healing_samples"] == 2  # calls 4 and 8 of its own count
    assert plain.stats()["healing_samples"] == 0
    assert mxdb.uninstall() and installed() is None
    # FlagGems' own function is back, not a wrapper of one of the hooks
    assert not hasattr(fm.fused_experts_impl, "__wrapped__")
