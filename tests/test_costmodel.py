"""The learned performance model's core: menu, features, plain-data trees, calibration, training."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mxdb.configs import FUSED_SLICE_MAX_SLOTS, KernelConfig
from mxdb.costmodel import calibration, trees
from mxdb.costmodel.features import FEATURE_NAMES, features
from mxdb.costmodel.menu import extras, menu
from mxdb.costmodel.train import Choice, Gate, Outcome, choose, key_data, train
from mxdb.errors import UsageError
from mxdb.profiles import get_profile
from mxdb.resources import check, flaggems_default_config
from mxdb.shapes import preset_shape

sklearn = pytest.importorskip("sklearn")


def test_menu_is_fixed_by_the_shape_and_has_no_duplicates() -> None:
    for tokens in (1, 64, 4096):
        shape = preset_shape("qwen3-30b-a3b", tokens)
        m = menu(shape)
        assert len({c.hash for c in m}) == len(m)
        assert [c.hash for c in m] == [c.hash for c in menu(shape)]
        slices = [c for c in m if c.impl == "fused_slice"]
        assert bool(slices) == (tokens * shape.topk <= FUSED_SLICE_MAX_SLOTS)
        assert {c.impl for c in m} >= {"flaggems", "fused_act"}


def test_extras_are_drawn_per_family_off_the_menu_and_fit() -> None:
    prof = get_profile("h200")
    a = preset_shape("mixtral-8x7b", 16)
    e1, e2 = extras(a, profile=prof), extras(a.with_tokens(1024), profile=prof)
    assert [c.hash for c in e1] == [c.hash for c in e2]  # per family, not per token count
    assert not {c.hash for c in e1} & {c.hash for c in menu(a)}
    assert all(check(c, a, prof).fits for c in e1)
    other = extras(preset_shape("olmoe-1b-7b", 16), profile=prof)
    assert [c.hash for c in other] != [c.hash for c in e1]


def test_features_name_every_entry_and_are_finite() -> None:
    shape = preset_shape("deepseek-v3", 256)
    for c in menu(shape):
        v = features(shape, "skewed", c)
        assert len(v) == len(FEATURE_NAMES)
        assert all(math.isfinite(x) for x in v)
    base = KernelConfig.uniform(flaggems_default_config(shape))
    v = dict(zip(FEATURE_NAMES, features(shape, "hot", base), strict=True))
    assert v["class_hot"] == 1.0 and v["class_uniform"] == 0.0
    assert v["d_block_m"] == v["d_block_n"] == v["d_num_warps"] == 0.0


def _xy(n: int = 300, d: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, d))
    y = np.sin(x[:, 0]) + 0.3 * x[:, 1] ** 2 - 0.2 * x[:, 2] + 0.05 * rng.normal(size=n)
    return x, y


@pytest.mark.parametrize("kind", ["gbt", "forest", "linear"])
def test_plain_data_trees_predict_what_scikit_learn_predicts(kind: str) -> None:
    from sklearn.ensemble import GradientBoostingRegressor, RandomForestRegressor
    from sklearn.linear_model import Ridge

    x, y = _xy()
    est = {
        "gbt": GradientBoostingRegressor(n_estimators=20, max_depth=3, random_state=0),
        "forest": RandomForestRegressor(n_estimators=10, min_samples_leaf=3, random_state=0),
        "linear": Ridge(alpha=1.0),
    }[kind].fit(x, y)
    model = trees.from_sklearn(est, kind, x.shape[1])
    np.testing.assert_allclose(trees.predict(model, x), est.predict(x), rtol=1e-12, atol=1e-12)
    if kind == "forest":
        per_tree = trees.members(model, x)
        assert per_tree.shape == (10, len(x))
        np.testing.assert_allclose(per_tree.mean(axis=0), est.predict(x), rtol=1e-12)


def test_a_model_rejects_rows_of_the_wrong_width() -> None:
    from mxdb.errors import UsageError

    model = {"kind": "linear", "n_features": 3, "coef": [1.0, 2.0, 3.0], "intercept": 0.0}
    assert trees.predict(model, [[1.0, 1.0, 1.0]]) == [6.0]
    with pytest.raises(UsageError, match="rows of 3 features"):
        trees.predict(model, [[1.0, 1.0]])


def test_calibration_is_monotone_and_its_error_is_the_binned_gap() -> None:
    pts = [(a / 20, a >= 12) for a in range(21)] * 3
    cal = calibration.fit(pts)
    confs = [calibration.confidence(cal, a / 10) for a in range(11)]
    assert confs == sorted(confs) and 0.0 <= confs[0] < 0.5 < confs[-1] <= 1.0
    # two bins: stated 0.15 with 1 win in 4; stated 0.95 with 4 wins in 4
    pairs = [(0.15, True), (0.15, False), (0.15, False), (0.15, False)] + [(0.95, True)] * 4
    assert calibration.calibration_error(pairs) == pytest.approx((4 * 0.1 + 4 * 0.05) / 8)
    assert calibration.calibration_error([]) is None
    assert calibration.fit([(0.5, True), (0.7, True)])["b"] > 0  # one outcome: a constant


def _sweep_keys() -> list[dict[str, object]]:
    """Sweep keys in the raw format of benchmarks/perf_sweep.py, with a made-up but consistent
    cost: ``fused_act`` 8% and block_m 16 3% faster than FlagGems' choice at small batches."""
    rng = np.random.default_rng(1)
    keys: list[dict[str, object]] = []
    for fam in ("qwen3-30b-a3b", "olmoe-1b-7b", "deepseek-v2-lite", "mixtral-8x7b"):
        for tokens in (1, 16, 256):
            shape = preset_shape(fam, tokens)
            base = KernelConfig.uniform(flaggems_default_config(shape))
            arms = []
            for j, c in enumerate([base, base, base, *menu(shape)[:10], *menu(shape)[13:16]]):
                gain = 1.0
                if j >= 3:
                    gain = 1.08 if c.impl == "fused_act" else 1.03 if c.gemm1.block_m == 16 else 0.9
                t = 100.0 / gain
                arms.append({
                    "config": c.model_dump(), "status": "ok", "error": None,
                    "role": "baseline" if j == 0 else "control" if j < 3 else "candidate",
                    "samples": [t * (1 + 0.002 * rng.normal()) for _ in range(7)],
                })  # fmt: skip
            keys.append({
                "family": fam, "shape": shape.to_dict(), "tokens": tokens, "source": "uniform",
                "routing_class": "uniform", "baseline": base.model_dump(), "arms": arms,
            })  # fmt: skip
    return keys


def test_a_checks_map_rises_with_the_predicted_speedup_and_steps_at_the_gate() -> None:
    pytest.importorskip("sklearn")
    # win rates of a check: about 0.6 below the step, rising with the prediction, 1 above
    pts = [(1.0 + 0.005 * i, i % 5 < 3 + (i > 6)) for i in range(12)]
    pts += [(1.06 + 0.01 * i, i != 3) for i in range(12)]
    cal = calibration.fit_gated(pts * 5, 1.06)
    assert set(cal) == {"a", "b", "c", "d", "step", "n"} and cal["a"] == 0.0
    assert cal["c"] > 0 and cal["d"] > 0 and cal["step"] == 1.06 and cal["n"] == 120
    confs = [calibration.confidence(cal, 0.0, 1.0 + 0.005 * i) for i in range(25)]
    assert confs == sorted(confs)
    below, above = calibration.confidence(cal, 0, 1.0599), calibration.confidence(cal, 0, 1.06)
    assert above - below > 0.05  # the step
    # the agreement does not enter a check's map; the sweep's map ignores the prediction
    assert calibration.confidence(cal, 1.0, 1.03) == calibration.confidence(cal, 0.2, 1.03)
    sweep = calibration.fit([(0.2, False), (0.9, True), (0.5, True), (0.4, False)])
    assert calibration.confidence(sweep, 0.5, 1.2) == calibration.confidence(sweep, 0.5, 1.0)
    # every choice on one side of the step: that input gets no coefficient
    one_side = calibration.fit_gated([(1.0 + 0.01 * i, i % 3 > 0) for i in range(5)], 1.06)
    assert one_side["d"] == 0.0 and one_side["c"] != 0.0
    # one verdict only, or none: a constant
    assert calibration.confidence(calibration.fit_gated([(1.1, True)] * 3, 1.06), 0, 1.0) > 0.99
    assert calibration.fit_gated([], 1.06)["n"] == 0


def test_training_is_deterministic_and_validates_leaving_each_family_out() -> None:
    keys = _sweep_keys()
    ks, rows = key_data(keys)
    assert len(ks) == 12 and len(rows) == sum(len(k["arms"]) - 2 for k in keys)  # type: ignore[arg-type]
    a, b = train(keys), train(keys)
    assert a == b
    assert a["families"] == sorted({str(k["family"]) for k in keys})
    assert set(a["lofo_calibrations"]) == set(a["families"])
    assert len(a["outcomes"]) == 12
    assert set(a["classes"]) == {"forest", "extra_trees"}
    # the pattern generalizes to the held-out families: their choices are fused_act, 8% faster
    assert all(o["outcome"] == "faster" for o in a["outcomes"])
    assert a["classes"][a["chosen"]]["chosen"] == pytest.approx(1.08, rel=0.01)
    ch = choose(a["model"], preset_shape("qwen2-57b-a14b", 16), "uniform", a["calibration"])
    assert ch.config is not None and ch.config.impl == "fused_act"
    assert ch.predicted > 1.0 and 0.0 <= (ch.confidence or 0.0) <= 1.0


def test_training_needs_three_families() -> None:
    from mxdb.errors import UsageError

    keys = [k for k in _sweep_keys() if k["family"] in ("qwen3-30b-a3b", "olmoe-1b-7b")]
    with pytest.raises(UsageError, match="at least 3 families"):
        train(keys)


def test_the_gate_needs_a_config_confidence_and_gain() -> None:
    c = menu(preset_shape("olmoe-1b-7b", 4))[0]
    gate = Gate(min_confidence=0.6, min_speedup=1.03)
    assert gate.admits(Choice(c, 1.05, 0.9, 0.7))
    assert not gate.admits(Choice(c, 1.02, 0.9, 0.7))
    assert not gate.admits(Choice(c, 1.05, 0.9, 0.5))
    assert not gate.admits(Choice(c, 1.05, 0.9, None))
    assert not gate.admits(Choice(None, 1.05, 0.9, 0.9))


def test_feature_set_2_extends_set_1_and_a_forest_names_its_set_by_its_width() -> None:
    from mxdb.costmodel.features import FEATURE_SETS, version_of

    assert FEATURE_SETS[2][: len(FEATURE_SETS[1])] == FEATURE_SETS[1]
    assert len({len(n) for n in FEATURE_SETS.values()}) == len(FEATURE_SETS)
    shape = preset_shape("qwen2-57b-a14b", 1)
    for c in menu(shape):
        v1, v2 = features(shape, "uniform", c, 1), features(shape, "uniform", c, 2)
        assert len(v1) == len(FEATURE_SETS[1]) and len(v2) == len(FEATURE_SETS[2])
        assert v2[: len(v1)] == v1 and all(math.isfinite(x) for x in v2)
    for v, names in FEATURE_SETS.items():
        assert version_of(len(names)) == v
    with pytest.raises(UsageError, match=r"matches no feature set.*37 \(version 1\)"):
        version_of(5)


def test_the_base_waves_feature_counts_flaggems_programs() -> None:
    # FlagGems' choice at Qwen2-57B M=1 (16/64/128): 8 experts x 1 tile x 5120/64 GEMM1
    # programs and 8 x 3584/64 GEMM2 programs over 132 SMs
    shape = preset_shape("qwen2-57b-a14b", 1)
    base = KernelConfig.uniform(flaggems_default_config(shape))
    assert (base.gemm1.block_m, base.gemm1.block_n) == (16, 64)
    v = dict(zip(FEATURE_NAMES, features(shape, "uniform", base), strict=True))
    act = 64 * (1 - (1 - 8 / 64) ** 1)
    assert v["log2_base_waves_gemm1"] == pytest.approx(math.log2(act * 80 / 132))
    assert v["log2_base_waves_gemm2"] == pytest.approx(math.log2(act * 56 / 132))
    assert v["log2_base_waves_min"] == v["log2_base_waves_gemm2"]
    assert v["d_log2_waves_min"] == pytest.approx(0.0)


def _outcome(family: str, predicted: float, outcome: str) -> Outcome:
    measured = {"faster": 1.1, "slower": 0.9, "same": 1.0}[outcome]
    return Outcome(0, family, "h", predicted, 1.0, measured, outcome, 1.2)


def test_the_gate_is_the_smallest_step_with_no_slower_answer_plus_the_guard() -> None:
    from mxdb.costmodel.train import GATE_GUARD, GATE_STEPS, select_gate

    sure = {"a": 0.0, "b": 50.0, "n": 1}  # every confidence 1.0
    outs = [
        _outcome("f1", 1.12, "faster"),
        _outcome("f1", 1.045, "slower"),  # answered by 1.03 and 1.04, not by 1.05
        _outcome("f2", 1.07, "faster"),
        _outcome("f2", 1.01, "slower"),  # never answered
    ]
    gate, steps = select_gate(outs, {"f1": sure, "f2": sure})
    assert [s["min_speedup"] for s in steps] == list(GATE_STEPS)
    assert [s["slower"] for s in steps[:3]] == [1, 1, 0]
    assert [s["answered"] for s in steps[:3]] == [3, 3, 2]
    assert gate.min_speedup == GATE_STEPS[2 + GATE_GUARD]
    assert gate.min_confidence == Gate().min_confidence
    # nothing safe on the grid: the largest step
    gate, _ = select_gate([_outcome("f1", 2.0, "slower")], {"f1": sure})
    assert gate.min_speedup == GATE_STEPS[-1]


def test_committed_models_of_both_feature_sets_answer() -> None:
    from pathlib import Path

    from mxdb.costmodel.model import PerfModel
    from mxdb.shapes import MoEShape

    ev = Path(__file__).resolve().parents[1] / "evidence"
    shape = MoEShape(experts=64, hidden=3584, intermediate=1280, topk=8, tokens=256, dtype="bf16")
    for name, width, gate in (("h200-perf-model", 37, 1.03), ("h200-perf-model-2", 41, 1.06),
                              ("h200-perf-model-3", 41, 1.06)):  # fmt: skip
        model = PerfModel.load(ev / name / "model.json")
        assert model.forest["n_features"] == width and model.gate.min_speedup == gate
        choice = model.choice(shape, "uniform")
        assert choice.config is not None and choice.confidence is not None
        # the third model's confidence is its check's map of the predicted speedup
        assert ("c" in model.calibration) == (name == "h200-perf-model-3")
        assert choice.confidence == calibration.confidence(
            model.calibration, choice.agreement, choice.predicted
        )
        assert model.answer(shape, "uniform") == (choice if model.gate.admits(choice) else None)
