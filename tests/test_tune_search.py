"""The multi-fidelity search and the verification rule, on the fake backend."""

from __future__ import annotations

import numpy as np
import pytest

from mxdb.configs import GemmConfig, KernelConfig
from mxdb.evidence.files import trace_hash
from mxdb.shapes import preset_shape
from mxdb.tune.backend import Backend
from mxdb.tune.fake import FakeBackend
from mxdb.tune.search import PointInput, RoutingInput, SearchResult, search
from mxdb.tune.space import SearchSpace, joint
from mxdb.tune.workload import SearchOptions


def _point(name: str = "mixtral-8x7b", m: int = 64, seed: int = 0) -> PointInput:
    shape = preset_shape(name, m)
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((m, shape.experts)), axis=1)[:, : shape.topk]
    syn = np.argsort(rng.random((m, shape.experts)), axis=1)[:, : shape.topk]
    return PointInput(
        shape=shape,
        replay=RoutingInput(ids, trace_hash(shape.experts, ids.tolist()), "uniform"),
        synthetic=RoutingInput(syn, trace_hash(shape.experts, syn.tolist()), "uniform"),
        seed=seed,
        run_prefix="t",
    )


def _run(fb: FakeBackend, point: PointInput, **opts: object) -> SearchResult:
    space = SearchSpace(point.shape, fb.profile())
    return search(fb, point, SearchOptions(**opts), space=space)  # type: ignore[arg-type]


def _true_best(fb: FakeBackend, point: PointInput) -> float:
    """Exhaustive (noiseless) best: every uniform config, then each GEMM on its own."""
    shape = point.shape
    counts = np.bincount(point.replay.ids.ravel(), minlength=shape.experts)
    space = SearchSpace(shape, fb.profile())

    def t(c: KernelConfig) -> float:
        if fb._static_failure(shape, c)[0] != "ok":
            return float("inf")
        return fb.true_us(shape, counts, c)

    grid = space.grid
    u = min((KernelConfig.uniform(g) for g in grid), key=t)
    g2 = min(grid, key=lambda g: t(joint(u.gemm1, g)))
    g1 = min(grid, key=lambda g: t(joint(g, g2)))
    return min(t(u), t(joint(g1, g2)))


def test_fake_backend_satisfies_protocol() -> None:
    assert isinstance(FakeBackend(), Backend)


@pytest.mark.parametrize(("name", "m"), [("mixtral-8x7b", 4), ("qwen3-30b-a3b", 256)])
def test_search_finds_the_true_best_within_one_percent(name: str, m: int) -> None:
    fb = FakeBackend(seed=3)
    point = _point(name, m)
    res = _run(fb, point)
    assert res.winner is not None
    counts = np.bincount(point.replay.ids.ravel(), minlength=point.shape.experts)
    got = fb.true_us(point.shape, counts, res.winner)
    assert got <= _true_best(fb, point) * 1.01
    # and far cheaper than timing the grid three times with 100 samples each
    assert (
        fb.counters.layer_calls < 0.1 * 3 * len(SearchSpace(point.shape, fb.profile()).grid) * 105
    )


def test_proxy_rejects_without_compiling_and_records_oor() -> None:
    fb = FakeBackend()
    point = _point()
    res = _run(fb, point, max_candidates=200)
    proxy = [m for m in res.measurements if m.fidelity == "proxy"]
    assert proxy and all(m.status == "oor" and m.error for m in proxy)
    assert not {m.config_hash for m in proxy} & fb.counters.compiled_hashes


def test_compile_failures_are_recorded_not_raised() -> None:
    point = _point()
    space = SearchSpace(point.shape, FakeBackend().profile())
    victims = [c.hash for c in space.uniform()[:400:7]]
    fb = FakeBackend(compile_errors=victims)
    res = _run(fb, point)
    # the fake device may also fail a victim with "oor" where the proxy was optimistic
    failed = {m.config_hash for m in res.measurements if m.fidelity == "compile"}
    kept = {c.hash for c in space.prune(space.uniform())[0]}
    assert set(victims) & kept and (set(victims) & kept) <= failed
    assert all(m.error for m in res.measurements if m.status == "compile_error")
    assert res.winner is not None and res.winner.hash not in victims


def test_wrong_winner_is_rejected_by_the_layer_check() -> None:
    point = _point("qwen3-30b-a3b", 16)
    first = _run(FakeBackend(seed=1), point)
    assert first.winner is not None
    bad = first.winner.hash
    second = _run(FakeBackend(seed=1, wrong=[bad]), point)
    wrong = [m for m in second.measurements if m.config_hash == bad and m.fidelity == "layer"]
    assert wrong and wrong[0].status == "wrong" and "layer check failed" in (wrong[0].error or "")
    assert second.winner is None or second.winner.hash != bad


def test_budget_stops_rungs_early_but_keeps_the_comparison() -> None:
    point = _point()
    full = _run(FakeBackend(), point)
    fb = FakeBackend()
    space = SearchSpace(point.shape, fb.profile())
    res = search(fb, point, SearchOptions(), space=space, budget_s=12.0, clock=fb.clock)
    assert res.budget_exhausted
    assert res.stages["synthetic_timed"] < full.stages["synthetic_timed"]
    roles = {m.role for m in res.measurements if m.fidelity in ("replay", "layer")}
    assert {"baseline", "control"} <= roles
    assert len(res.control_samples[0]) >= 2 * SearchOptions().replay_reps


def test_line_neighbours_move_one_field_to_every_other_value() -> None:
    point = _point()
    space = SearchSpace(point.shape, FakeBackend().profile())
    g = FakeBackend().baseline_config(point.shape).gemm1
    line = space.neighbours(g, line=True)
    assert len(line) == 16  # (5 + 4 + 3 + 4 + 2 + 4) values, less the current one of each field
    base = g.model_dump()
    for n in line:
        assert sum(1 for k, v in n.model_dump().items() if v != base[k]) == 1
    assert set(space.neighbours(g)) <= set(line)


def test_rung0_holds_the_baselines_line_neighbourhood_whatever_is_drawn() -> None:
    fb = FakeBackend()
    point = _point("qwen3-30b-a3b", 16)
    res = _run(fb, point, max_candidates=4, halving_rounds=1)
    space = SearchSpace(point.shape, fb.profile())
    near = [KernelConfig.uniform(g) for g in space.neighbours(res.baseline.gemm1, line=True)]
    kept, _ = space.prune(near)
    rung0 = {m.config_hash for m in res.measurements if m.fidelity == "synthetic"}
    assert kept and {c.hash for c in kept} <= rung0


class _SeedLog(FakeBackend):
    def __init__(self) -> None:
        super().__init__()
        self.seeds: list[int] = []

    def time(self, shape, topk_ids, configs, *, reps, seed, method="graph", order_seed=None):  # type: ignore[no-untyped-def]
        self.seeds.append(seed)
        return super().time(shape, topk_ids, configs, reps=reps, seed=seed, method=method)


def test_every_timing_uses_the_points_seed() -> None:
    """One set of inputs per point: a GPU backend builds its weights once, not per rung."""
    fb = _SeedLog()
    point = _point(seed=5)
    _run(fb, point, max_candidates=30, refine_steps=2)
    assert fb.seeds and set(fb.seeds) == {5}


def test_refinement_moves_block_m_of_both_gemms_together() -> None:
    fb = FakeBackend(seed=1)
    point = _point("qwen3-30b-a3b", 256)
    res = _run(fb, point, max_candidates=30, refine_steps=1)
    replay = [
        KernelConfig.parse(m.config)
        for m in res.measurements
        if m.fidelity == "replay" and m.status == "ok"
    ]
    joint_bm = [
        c
        for c in replay
        if c.gemm1 != c.gemm2 and c.gemm1.block_m == c.gemm2.block_m == c.align_block
    ]
    assert {c.align_block for c in joint_bm} >= {16, 32}


def test_peer_seeds_always_reach_the_replayed_comparison() -> None:
    """A peer table's config that ran is timed on the replayed trace even when it ranked low,
    so a verified answer is never one the peer's table beats on the point's own routing."""
    from dataclasses import replace

    fb = FakeBackend(seed=3)
    # a deliberately poor seed: it ranks far from the top in the synthetic rungs
    seed_cfg = KernelConfig.uniform(
        GemmConfig(block_m=16, block_n=32, block_k=64, num_warps=8, num_stages=5)
    )
    point = replace(_point("mixtral-8x7b", 64), peer_seeds=(seed_cfg,))
    res = _run(fb, point, max_candidates=24, halving_rounds=2, finalists=2, replicates=2)
    synthetic = {m.config_hash for m in res.measurements if m.fidelity == "synthetic"}
    # a finalist's replayed samples are recorded with its layer check (fidelity "layer")
    finals = {m.config_hash: m for m in res.measurements if m.fidelity == "layer"}
    assert seed_cfg.hash in synthetic and seed_cfg.hash in finals
    seed_final = finals[seed_cfg.hash]
    assert seed_final.samples_us and seed_final.trace_hash == point.replay.trace_hash


def test_seed_lines_off_keeps_the_first_rung_to_the_drawn_configs() -> None:
    fb = FakeBackend(seed=3)
    point = _point("mixtral-8x7b", 16)
    on = _run(fb, point, max_candidates=8, halving_rounds=1, finalists=2, replicates=2)
    off = _run(fb, point, max_candidates=8, halving_rounds=1, finalists=2, replicates=2,
               seed_lines=False)  # fmt: skip

    def pool(r: SearchResult) -> int:  # configs that entered the first rung, before the proxy
        return r.stages["compiled"] + r.stages["proxy_rejected"]

    assert pool(off) <= 9  # the drawn configs and FlagGems' choice
    assert pool(on) > pool(off) + 8  # plus the one-field line search
