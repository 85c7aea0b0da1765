"""A performance model orders and prunes the search's first rung (``search(..., model=...)``)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from mxdb.cli import cli
from mxdb.configs import GemmConfig, KernelConfig
from mxdb.costmodel import trees
from mxdb.costmodel.features import FEATURE_NAMES, features
from mxdb.costmodel.model import MODEL_SCHEMA, PerfModel
from mxdb.evidence.files import trace_hash
from mxdb.shapes import preset_shape
from mxdb.tune.fake import FakeBackend
from mxdb.tune.search import PointInput, RoutingInput, SearchResult, model_ranking, search
from mxdb.tune.space import SearchSpace
from mxdb.tune.workload import MODEL_KEEP, SearchOptions, load_workload, parse_workload

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "examples" / "workloads" / "smoke.yaml"

#: a linear model: larger GEMM1 block_n and fewer warps predicted faster (any spread will do)
COEF = {"log2_block_n1": 0.02, "num_warps": -0.004, "num_stages": 0.003, "log2_block_k1": -0.01}


def model_doc(families: list[str], coef: dict[str, float] | None = None) -> dict[str, Any]:
    """A ``mxdb.perf-model`` document holding a linear model (``mxdb.costmodel.trees``)."""
    weights = coef or COEF
    return {
        "schema": MODEL_SCHEMA,
        "schema_version": "1.0",
        "model": {
            "kind": "linear",
            "n_features": len(FEATURE_NAMES),
            "coef": [weights.get(n, 0.0) for n in FEATURE_NAMES],
            "intercept": 0.0,
        },
        "calibration": {"a": 0.0, "b": 0.0, "n": 0},
        "gate": {"min_confidence": 0.6, "min_speedup": 1.03},
        "fingerprint_hash": "0" * 16,
        "shape_families": families,
        "families": ["mixtral-8x7b"],
    }


def write_model(path: Path, families: list[str] | None = None) -> Path:
    """A model file trained (so it says) on Mixtral-8x7B only."""
    fams = families if families is not None else [preset_shape("mixtral-8x7b", 1).family]
    path.write_text(json.dumps(model_doc(fams)))
    return path


def _model() -> PerfModel:
    return PerfModel.from_doc(model_doc([preset_shape("mixtral-8x7b", 1).family]))


def _point(name: str = "qwen3-30b-a3b", m: int = 16, seed: int = 0) -> PointInput:
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


#: rung 0 alone draws proxy rejections, compile failures and synthetic timings: no joint
#: refinement, no other implementation
ISOLATED = {"joint": False, "impls": ["flaggems"], "halving_rounds": 1, "finalists": 2}


def _run(point: PointInput, model: PerfModel | None, **opts: Any) -> SearchResult:
    fb = FakeBackend(seed=3)
    space = SearchSpace(point.shape, fb.profile())
    return search(fb, point, SearchOptions(**{**ISOLATED, **opts}), space=space, model=model)


def _entered(res: SearchResult) -> set[str]:
    """What entered rung 0: every config proxy-rejected, failed to compile or timed there."""
    return {
        m.config_hash for m in res.measurements if m.fidelity in ("proxy", "compile", "synthetic")
    }


def _always(point: PointInput, seeds: tuple[KernelConfig, ...] = ()) -> set[str]:
    """FlagGems' choice, the peer seeds and every uniform config one field away from them."""
    fb = FakeBackend()
    space = SearchSpace(point.shape, fb.profile())
    base = fb.baseline_config(point.shape)
    near = {
        KernelConfig.uniform(g).hash
        for c in (base, *seeds)
        for g in space.neighbours(c.gemm1, line=True)
    }
    return near | {base.hash} | {c.hash for c in seeds}


def test_the_model_keeps_its_best_predicted_configs_and_the_seeds() -> None:
    point = _point()
    seed_cfg = KernelConfig.uniform(
        GemmConfig(block_m=16, block_n=32, block_k=64, num_warps=8, num_stages=5)
    )
    point = replace(point, peer_seeds=(seed_cfg,))
    model = _model()
    keep = 12
    res = _run(point, model, model_keep=keep)
    # the model's ranking, computed here independently: every uniform config that fits
    space = SearchSpace(point.shape, FakeBackend().profile())
    fits = [c for c in space.uniform() if space.verdict(c) is None]
    logs = trees.predict(model.forest, [features(point.shape, "uniform", c) for c in fits])
    order = sorted(range(len(fits)), key=lambda j: (-logs[j], j))
    top = [fits[j] for j in order[:keep]]
    assert [c for c, _ in res.model_kept] == top
    assert [s for _, s in res.model_kept] == pytest.approx(
        [math.exp(logs[j]) for j in order[:keep]]
    )
    # rung 0 = the best predicted plus what always enters, nothing else
    assert _entered(res) == {c.hash for c in top} | _always(point, (seed_cfg,))
    assert res.stages["model_kept"] == keep and res.stages["model_ranked"] == len(fits)
    assert seed_cfg.hash in {m.config_hash for m in res.measurements if m.fidelity == "layer"}


def test_a_model_replaces_the_random_draw() -> None:
    point = _point()
    a = _run(point, _model(), model_keep=8, max_candidates=200)
    b = _run(point, _model(), model_keep=8)
    assert _entered(a) == _entered(b)
    assert len(_entered(a)) <= 8 + len(_always(point))


def test_seed_lines_off_leaves_the_models_best_and_flaggems_choice() -> None:
    point = _point()
    res = _run(point, _model(), model_keep=6, seed_lines=False)
    base = FakeBackend().baseline_config(point.shape)
    assert _entered(res) == {c.hash for c, _ in res.model_kept} | {base.hash}


def _old_pool(point: PointInput, options: SearchOptions) -> set[str]:
    """The first rung as the search drew it before models existed (a copy of that code)."""
    fb = FakeBackend()
    space = SearchSpace(point.shape, fb.profile())
    baseline = fb.baseline_config(point.shape)
    seeds = [c for c in point.peer_seeds if c.hash != baseline.hash]
    near = [
        KernelConfig.uniform(g)
        for c in (baseline, *seeds)
        for g in space.neighbours(c.gemm1, line=True)
    ]
    pool = list({c.hash: c for c in [*space.uniform(), *seeds, baseline]}.values())
    if options.max_candidates is not None and len(pool) > options.max_candidates:
        rng = np.random.default_rng(point.seed)
        keep = set(rng.choice(len(pool), size=options.max_candidates, replace=False).tolist())
        always = {c.hash for c in (*seeds, *near)} | {baseline.hash}
        pool = [c for i, c in enumerate(pool) if i in keep or c.hash in always]
    return {c.hash for c in pool} | {c.hash for c in near}


@pytest.mark.parametrize("max_candidates", [24, 60])
def test_without_a_model_the_first_rung_is_unchanged(max_candidates: int) -> None:
    seed_cfg = KernelConfig.uniform(
        GemmConfig(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=3)
    )
    point = replace(_point("mixtral-8x7b", 64, seed=7), peer_seeds=(seed_cfg,))
    res = _run(point, None, max_candidates=max_candidates)
    assert _entered(res) == _old_pool(
        point, SearchOptions(**ISOLATED, max_candidates=max_candidates)
    )
    assert res.model_kept == [] and "model_kept" not in res.stages


def test_one_batched_prediction_per_point(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = trees.predict

    def counting(model: Any, x: Any) -> list[float]:
        calls.append(len(x))
        return real(model, x)

    monkeypatch.setattr(trees, "predict", counting)
    point = _point()
    res = _run(point, _model(), model_keep=10)
    assert calls == [res.stages["model_ranked"]]
    assert res.model_s < 5.0  # host seconds, no GPU


def test_model_ranking_is_best_first_and_fits_the_device() -> None:
    point = _point("mixtral-8x7b", 256)
    fb = FakeBackend()
    space = SearchSpace(point.shape, fb.profile())
    ranked = model_ranking(_model(), space, point.shape, "skewed")
    speeds = [s for _, s in ranked]
    assert speeds == sorted(speeds, reverse=True)
    assert all(space.verdict(c) is None for c, _ in ranked)
    assert len(ranked) == len(space.prune(space.uniform())[0])


def test_model_keep_is_an_option_that_hashes_only_when_set() -> None:
    wl = load_workload(SMOKE)
    assert wl.search.model_keep == MODEL_KEEP
    data = wl.model_dump(mode="json", exclude={"base_dir"})
    same = parse_workload({**data, "search": {**data["search"], "model_keep": MODEL_KEEP}})
    other = parse_workload({**data, "search": {**data["search"], "model_keep": 12}})
    assert same.content_hash == wl.content_hash != other.content_hash
    with pytest.raises(Exception, match="model_keep"):
        parse_workload({**data, "search": {**data["search"], "model_keep": 0}})


def test_cli_tune_perf_model_on_the_fake_backend(tmp_path: Path) -> None:
    """``mxdb tune smoke.yaml --perf-model MODEL.json`` end to end: every point's first rung
    holds the model's best configs and the seeds' line neighbourhood, not the whole grid."""
    from mxdb.audit.checks import audit_bundle
    from mxdb.store import Store

    model = write_model(tmp_path / "model.json")
    db = f"sqlite:///{tmp_path / 'db.sqlite'}"
    args = ["tune", str(SMOKE), "--db", db, "--out", str(tmp_path / "ev"), "--backend", "fake"]
    res = CliRunner().invoke(cli, [*args, "--no-progress", "--json", "--perf-model", str(model)])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["points_done"] == report["points_total"] == 4
    with Store.open(db) as store:
        ms = store.measurements(job=report["job"])
    # point (run-id prefix) -> configs timed in rung 0: its synthetic timings before the first
    # timing on the replayed trace (rung 1), in the order the search recorded them
    rung0: dict[str, set[str]] = {}
    past: set[str] = set()
    for m in ms:
        prefix = m.run_id.rsplit("-", 1)[0]
        if m.fidelity == "replay":
            past.add(prefix)
        elif m.fidelity == "synthetic" and prefix not in past:
            rung0.setdefault(prefix, set()).add(m.config_hash)
    assert len(rung0) == 4
    grid = len(SearchSpace(preset_shape("qwen3-30b-a3b", 4), FakeBackend().profile()).grid)
    for hashes in rung0.values():
        # the model's 30, FlagGems' line and the incumbent row's (vLLM's H200 table, a
        # seed; some of it shared), never the 1,920-config grid
        assert MODEL_KEEP <= len(hashes) <= MODEL_KEEP + 2 * 17 < grid
    for b in report["bundles"]:
        assert audit_bundle(Path(b)).findings == ()


def test_cli_tune_perf_model_refuses_what_is_not_a_model(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"architectures": ["MixtralForCausalLM"]}))
    args = ["tune", str(SMOKE), "--backend", "fake", "--db", f"sqlite:///{tmp_path / 'd.sqlite'}"]
    res = CliRunner().invoke(cli, [*args, "--perf-model", str(bad)])
    assert res.exit_code == 2 and "not a performance model" in res.output
    res = CliRunner().invoke(cli, [*args, "--perf-model", str(tmp_path / "none.json")])
    assert res.exit_code == 2
