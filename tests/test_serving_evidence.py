"""Serving evidence (``serving.json``): publish from raw output, audit, and tampering caught.

The raw files are simulated on the CPU the way ``benchmarks/serving.py hooked`` and
``healing`` write them; the committed H200 bundle is audited as is, and every figure it
declares (and every raw sample it keeps) is edited in turn: each edit must give a finding.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import random
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mxdb import verdict
from mxdb.audit import CHECKS, audit_paths
from mxdb.audit.claims import Context, audit_claim
from mxdb.audit.serving import KIND
from mxdb.errors import EvidenceError
from mxdb.evidence import stats
from mxdb.evidence.files import dumps
from mxdb.evidence.peers import judge
from mxdb.evidence.serving import (
    POINT_INPUTS,
    REPORT_FILE,
    SERVING_FILE,
    TARGETS,
    from_raw,
    render_report,
    round_order,
)
from mxdb.evidence.writer import write_manifest
from mxdb.fingerprint import H200

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "serving.py"
COMMITTED = REPO / "evidence" / "h200-serving"
TOL = (stats.REL_TOL, stats.ABS_TOL)
FP = dict(H200)
CFG = {
    "gemm1": {"block_m": 16, "block_n": 64, "block_k": 128, "group_m": 16, "num_warps": 4,
              "num_stages": 2},
    "gemm2": {"block_m": 16, "block_n": 64, "block_k": 128, "group_m": 16, "num_warps": 4,
              "num_stages": 2},
    "align_block": 16,
}  # fmt: skip
STEPS, CHUNK = 40, 10


def _serving() -> Any:
    spec = importlib.util.spec_from_file_location("bench_serving_pub", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _point(
    rng: random.Random, family: str, m: int, routing: str, stock: float, hooked: float,
    fallback: bool = False,
) -> dict[str, Any]:  # fmt: skip
    def s(c: float) -> list[float]:
        return [c * (1 + rng.uniform(-0.005, 0.005)) for _ in range(7)]

    stats_ = {"calls": 143, "dispatched": 0 if fallback else 143, "fallback": 143 if fallback
              else 0, "lean": 0 if fallback else 143, "lean_fallback": 143 if fallback else 0,
              "layers": 1}  # fmt: skip
    return {
        "family": family, "tokens": m, "routing": routing, "routing_params": {}, "seed": m,
        "routing_class": "uniform",
        "decision": {"level": "fallback", "reason": "baseline_measured", "entry_id": None,
                     "config": None} if fallback else
                    {"level": "exact", "reason": "exact_match", "entry_id": 7, "config": CFG},
        "path": "lean_fallback" if fallback else "lean", "hook_stats": stats_,
        "equal_to_stock": True, "max_abs_diff_vs_stock": 0.0, "calls_per_sample": 20,
        "eager_us": {"stock": s(stock), "stock2": s(stock), "hooked": s(hooked)},
    }  # fmt: skip


def raw_pair(slower: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """A hooked.json and a healing.json as benchmarks/serving.py writes them."""
    rng = random.Random(5)
    points = [
        _point(rng, "qwen3-30b-a3b", 1, "uniform", 480.0, 70.0),
        _point(rng, "qwen3-30b-a3b", 4, "zipf", 360.0, 80.0),
        _point(rng, "mixtral-8x7b", 2, "hot", 360.0, 400.0 if slower else 300.0),
        _point(rng, "mixtral-8x7b", 4, "uniform", 430.0, 430.0, fallback=True),
        _point(rng, "mixtral-8x7b", 64, "uniform", 900.0, 880.0),
    ]
    common = {"fingerprint": FP, "fingerprint_hash": None, "errors": [],
              "store_export": "evidence/store-export.json", "import": {"read": 81, "added": 81},
              "dispatch_fingerprint": "6f0a9d03427b6eb8"}  # fmt: skip
    hooked = {
        **common, "dispatch_fingerprint_is_live": True, "rounds": 7, "points": points,
        "trace_source": "generated, seed = M", "wall_s": 12.0,
        "capture": {"ok": True, "tokens": 2, "capture_deferred": 2, "monitor_copies_after": 1,
                    "healing_samples_after": 1, "lean": 5, "dispatched": 5},
    }  # fmt: skip

    def rates(n: int, c: float) -> list[float]:
        return [c * (1 + rng.uniform(-0.02, 0.02)) for _ in range(n)]

    healing = {
        **common, "model": {"family": "E128-H2048-I768-k8", "layers": 8, "dtype": "bf16"},
        "factor": 10, "tokens": 4, "routing_class": "uniform",
        "target": {"config": CFG, "entry_id": 20},
        "alternatives": [{"config": CFG, "entry_id": 20}, {"config": CFG, "entry_id": 11}],
        "slow_layers": [0, 1], "warm_stats": {"calls": 112, "lean": 112},
        "clean": {"tokens_per_s": rates(STEPS // CHUNK, 2600.0)},
        "static": {"clean_tokens_per_s": rates(STEPS // 2 // CHUNK, 2600.0),
                   "injected_tokens_per_s": rates(STEPS // CHUNK, 750.0),
                   "slowed_calls": STEPS * 2},
        "healing": {"options": {"sample_every": 61, "baseline": "calibrate"},
                    "clean_tokens_per_s": rates(STEPS // 2 // CHUNK, 2600.0),
                    "injected_tokens_per_s": [750.0, *rates(2 * STEPS // CHUNK - 1, 2650.0)],
                    "slowed_calls": 30,
                    "transitions": [
                        {"sample": 5, "key": "k", "kind": "calibrated", "from": 0, "to": 0,
                         "ratio": None},
                        {"sample": 12, "key": "k", "kind": "demote", "from": 0, "to": 1,
                         "ratio": 6.1}],
                    "overrides": ["k"], "stats": {"calls": 800, "healing_samples": 13}},
        "ladder": {"tokens_per_s": {"off": rates(3, 2600.0), "4096": rates(3, 2598.0),
                                    "64": rates(3, 2480.0), "4": rates(3, 1600.0)}},
        "wall_s": 12.0,
    }  # fmt: skip
    return hooked, healing


def _publish(root: Path, slower: bool = False) -> Path:
    hooked, healing = raw_pair(slower)
    (root / "hooked.json").write_text(json.dumps(hooked))
    (root / "healing.json").write_text(json.dumps(healing))
    notes = root / "notes.md"
    notes.write_text("First paragraph\nof two lines.\n\nSecond paragraph.\n")
    bundle = root / "h200-serving"
    _serving().publish(
        root / "hooked.json", root / "healing.json", bundle, notes_path=notes,
        steps=STEPS, chunk=CHUNK,
    )  # fmt: skip
    return bundle


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _publish(tmp_path_factory.mktemp("serving"))


@pytest.fixture
def bundle(published: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "h200-serving"
    shutil.copytree(published, dst)
    return dst


def _checks(root: Path) -> set[str]:
    res = audit_paths([root])
    for f in res.findings:
        assert f.check in CHECKS, f
    return {f.check for f in res.findings}


def _edit(root: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Change serving.json and re-manifest, so that only the semantic checks can catch it."""
    doc = json.loads((root / SERVING_FILE).read_text())
    change(doc)
    (root / SERVING_FILE).write_bytes(dumps(doc))
    write_manifest(root, bundle_id="h200-serving", milestone="h200-serving")


# -- publishing -------------------------------------------------------------------------------


def test_published_bundle_passes_and_judges_with_the_verdict_rule(published: Path) -> None:
    assert _checks(published) == set()
    doc = json.loads((published / SERVING_FILE).read_text())
    assert doc["schema"] == "mxdb.serving" and doc["schema_version"] == "1.1"
    for p in doc["hooked"]["points"]:
        s = p["samples"]
        v = verdict.compare([s["stock"], s["stock2"]], s["hooked"])
        assert (p["outcome"], p["speedup"], p["noise_band"]) == (v.outcome, v.speedup, v.noise_band)
        assert p["round_order"] == round_order(p["tokens"], 7)
        assert p["median_ratio"] == stats.median(s["stock"]) / stats.median(s["hooked"])
    f = doc["hooked"]["figures"]
    assert (f["n_points"], f["n_small_points"], f["points_slower"]) == (5, 4, 0)
    assert f["points_by_path"] == {"lean": 4, "lean_fallback": 1}
    small = [p["speedup"] for p in doc["hooked"]["points"] if p["tokens"] <= 16]
    assert f["small_geomean_speedup"] == pytest.approx(stats.geomean(small))
    g = doc["healing"]["figures"]
    clean = stats.median(doc["healing"]["samples"]["clean"])
    assert g["healed_over_clean"] == pytest.approx(
        stats.median(doc["healing"]["samples"]["healing_injected"][-4:]) / clean
    )
    # a window of 20 steps of 8 layers after 5 warm-up steps: calls 41-200 of the hook
    assert g["ladder_healing_samples_in_window"] == {"off": 0, "4096": 0, "64": 3, "4": 40}
    assert g["ladder_monitor_copies_in_window"] == {"off": 0, "4096": 0, "64": 0, "4": 40}
    assert {t["name"] for t in doc["targets"]} == {t.name for t in TARGETS}
    for t in doc["targets"]:
        assert t["passed"] is judge(t["comparison"], t["measured"], t["threshold"])
    assert doc["notes"] == ["First paragraph of two lines.", "Second paragraph."]
    assert (published / REPORT_FILE).read_text() == render_report(doc)
    fp = json.loads((published / "fingerprint.json").read_text())
    assert doc["fingerprint_hash"] == fp["hash"]


def test_a_point_slower_in_every_round_misses_the_target(tmp_path: Path) -> None:
    root = _publish(tmp_path, slower=True)
    assert _checks(root) == set()
    doc = json.loads((root / SERVING_FILE).read_text())
    f = doc["hooked"]["figures"]
    assert f["points_slower"] == 1 and f["slower_points"] == ["mixtral-8x7b M=2 hot"]
    t = next(t for t in doc["targets"] if t["name"] == "hooked_none_slower")
    assert t["measured"] == 1.0 and t["passed"] is False


def test_incomplete_or_inconsistent_raw_is_refused() -> None:
    hooked, healing = raw_pair()
    with pytest.raises(EvidenceError, match="chunk counts"):
        from_raw(hooked, healing)  # the defaults (400 steps) do not fit 40-step phases
    other = {**healing, "fingerprint": {**FP, "driver": "1.0"}}
    with pytest.raises(EvidenceError, match="different environments"):
        from_raw(hooked, other, steps=STEPS, chunk=CHUNK)
    short = copy.deepcopy(hooked)
    short["points"][0]["eager_us"]["hooked"].pop()
    with pytest.raises(EvidenceError, match="samples of every arm"):
        from_raw(short, healing, steps=STEPS, chunk=CHUNK)
    with pytest.raises(EvidenceError, match="lacks"):
        from_raw(hooked, {**healing, "ladder": None}, steps=STEPS, chunk=CHUNK)


def test_publish_help_runs_without_a_gpu() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "publish", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "--notes" in out.stdout


# -- tampering: files -------------------------------------------------------------------------


def test_unsealed_edit_is_a_manifest_change(bundle: Path) -> None:
    doc = json.loads((bundle / SERVING_FILE).read_text())
    doc["hooked"]["figures"]["small_geomean_speedup"] = 3.0
    (bundle / SERVING_FILE).write_bytes(dumps(doc))
    assert "manifest.changed" in _checks(bundle)


def test_edited_report_is_found(bundle: Path) -> None:
    text = (bundle / REPORT_FILE).read_text().replace("slower 0", "slower 7", 1)
    (bundle / REPORT_FILE).write_text(text)
    write_manifest(bundle, bundle_id="h200-serving", milestone="h200-serving")
    assert _checks(bundle) == {"serving.report_mismatch"}


def test_invalid_sample_is_found(bundle: Path) -> None:
    def negate(doc: dict[str, Any]) -> None:
        doc["hooked"]["points"][1]["samples"]["stock2"][3] = -1.0

    _edit(bundle, negate)
    assert _checks(bundle) == {"serving.sample_invalid"}  # the report shows no samples


def test_unpaired_samples_are_found(bundle: Path) -> None:
    def drop(doc: dict[str, Any]) -> None:
        doc["hooked"]["points"][0]["samples"]["hooked"].pop()

    _edit(bundle, drop)
    assert "serving.layout_mismatch" in _checks(bundle)


def test_path_contradicting_the_decision_is_found(bundle: Path) -> None:
    def relabel(doc: dict[str, Any]) -> None:
        doc["hooked"]["points"][3]["path"] = "lean"

    _edit(bundle, relabel)
    assert "serving.layout_mismatch" in _checks(bundle)


def test_pass_claimed_for_a_missed_target_is_found(bundle: Path) -> None:
    def cheat(doc: dict[str, Any]) -> None:
        t = next(t for t in doc["targets"] if t["name"] == "healed_vs_clean")
        t["threshold"] = 1.5  # a stricter bar, still "passed"

    _edit(bundle, cheat)
    assert {"serving.target_threshold_mismatch"} <= _checks(bundle)


def test_hiding_a_slow_point_is_found(tmp_path: Path) -> None:
    root = _publish(tmp_path, slower=True)

    def hide(doc: dict[str, Any]) -> None:
        p = doc["hooked"]["points"][2]
        p["outcome"] = "same"
        doc["hooked"]["figures"]["points_slower"] = 0
        doc["hooked"]["figures"]["slower_points"] = []
        t = next(t for t in doc["targets"] if t["name"] == "hooked_none_slower")
        t.update(measured=0.0, passed=True)

    _edit(root, hide)
    checks = _checks(root)
    assert {"serving.verdict_mismatch", "serving.count_mismatch"} <= checks
    assert {"serving.target_measured_mismatch", "serving.target_verdict_mismatch"} <= checks


# -- tampering: every declared figure and raw sample of the committed bundle -----------------


class _Sink:
    fp_hash: str | None = None

    def __init__(self) -> None:
        self.checks: list[str] = []

    def add(self, check: str, file: str, field: str, expected: Any, found: Any, msg: str) -> None:
        self.checks.append(check)


def _findings(doc: dict[str, Any]) -> list[str]:
    sink = _Sink()
    audit_claim(KIND, sink, doc, Context(), TOL)
    return sink.checks


def _leaves(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _leaves(v, (*path, i))
    else:
        yield path


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    _get(doc, path[:-1])[path[-1]] = value


def _changed(x: Any) -> Any:
    if isinstance(x, bool):
        return not x
    if isinstance(x, int):
        return x + 1
    if isinstance(x, float):
        return x * 1.01 + 0.01
    if isinstance(x, str):
        return x + "?"
    return 0.5  # None


@pytest.fixture(scope="module")
def committed() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((COMMITTED / SERVING_FILE).read_text())
    return doc


def _declared(doc: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Every leaf the document declares as derived: per-point figures, both parts' figures,
    the targets and the definitions."""
    paths: list[tuple[Any, ...]] = []
    for i, p in enumerate(doc["hooked"]["points"]):
        for k in p:
            if k not in POINT_INPUTS:
                paths += _leaves(p[k], ("hooked", "points", i, k))
    for part in ("hooked", "healing"):
        paths += _leaves(doc[part]["figures"], (part, "figures"))
    paths += _leaves(doc["targets"], ("targets",))
    paths += _leaves(doc["definitions"], ("definitions",))
    return paths


def test_committed_bundle_passes_audit_with_its_figures(committed: dict[str, Any]) -> None:
    assert audit_paths([COMMITTED]).findings == ()
    assert _findings(committed) == []
    f, g = committed["hooked"]["figures"], committed["healing"]["figures"]
    assert (f["n_points"], f["n_small_points"]) == (30, 30)
    assert f["small_geomean_speedup"] == pytest.approx(2.302, abs=5e-4)
    assert f["small_geomean_median_ratio"] == pytest.approx(2.258, abs=5e-4)
    assert f["points_slower"] == 0 and f["capture_ok"] == 1.0
    assert f["slower_by_median_rule_points"] == ["mixtral-8x7b M=2 hot", "mixtral-8x7b M=4 zipf"]
    assert g["healed_over_clean"] == pytest.approx(1.0377, abs=5e-5)
    assert g["ladder_healing_samples_in_window"]["4096"] == 0
    assert all(t["passed"] for t in committed["targets"])
    fp = json.loads((COMMITTED / "fingerprint.json").read_text())
    assert committed["fingerprint_hash"] == fp["hash"] == "6f0a9d03427b6eb8"


def test_every_declared_figure_is_checked(committed: dict[str, Any]) -> None:
    paths = _declared(committed)
    assert len(paths) > 1000
    missed = []
    for path in paths:
        doc = copy.deepcopy(committed)
        _set(doc, path, _changed(_get(doc, path)))
        found = _findings(doc)
        if not found or not all(c.startswith("serving.") for c in found):
            missed.append(path)
    assert missed == []


def test_every_list_and_mapping_figure_is_checked(committed: dict[str, Any]) -> None:
    parts = [("hooked", "figures"), ("healing", "figures")]
    grown = 0
    for part in parts:
        for k, v in _get(committed, part).items():
            if not isinstance(v, (list, dict)):
                continue
            doc = copy.deepcopy(committed)
            target = _get(doc, (*part, k))
            if isinstance(target, list):
                target.append("mixtral-8x7b M=1 uniform")
            else:
                target["extra"] = 1
            grown += 1
            assert _findings(doc), (part, k)
    assert grown >= 10


def test_every_raw_sample_is_checked(committed: dict[str, Any]) -> None:
    paths: list[tuple[Any, ...]] = []
    for i, p in enumerate(committed["hooked"]["points"]):
        paths += _leaves(p["samples"], ("hooked", "points", i, "samples"))
    paths += _leaves(committed["healing"]["samples"], ("healing", "samples"))
    assert len(paths) > 700
    missed = []
    for path in paths:
        doc = copy.deepcopy(committed)
        _set(doc, path, _get(doc, path) * 1.05)
        if not _findings(doc):
            missed.append(path)
    assert missed == []


def test_malformed_setup_is_a_finding_not_a_crash(committed: dict[str, Any]) -> None:
    doc = copy.deepcopy(committed)
    doc["healing"]["samples"]["ladder"]["every"] = doc["healing"]["samples"]["ladder"].pop("64")
    doc["healing"]["setup"]["model"]["layers"] = "eight"
    assert set(_findings(doc)) == {"serving.layout_mismatch"}


def test_model_decoder_run_publishes_its_setup_and_ladder_windows(tmp_path: Path) -> None:
    hooked, healing = raw_pair()
    healing["decoder"] = "qwen3-moe"
    healing["model"] = {**healing["model"], "decoder": "transformers Qwen3MoeForCausalLM"}
    healing["model_check"] = {"steps": 4, "max_abs_logit_diff": 0.03, "max_abs_logit": 4.5}
    orders = [["4", "off", "64", "4096"], ["off", "4096", "4", "64"], ["64", "4", "off", "4096"]]
    healing["ladder"]["steps"] = 1024
    healing["ladder"]["orders"] = orders
    healing["ladder"]["counters"] = {
        k: [{"monitor_copies": 0 if k == "off" else 8 * 1029 // int(k),
             "healing_samples": 0 if k == "off" else 8 * 1029 // int(k)}] * 3
        for k in ("off", "4096", "64", "4")
    }  # fmt: skip
    (tmp_path / "hooked.json").write_text(json.dumps(hooked))
    (tmp_path / "healing.json").write_text(json.dumps(healing))
    bundle = tmp_path / "h200-serving-model"
    _serving().publish(
        tmp_path / "hooked.json", tmp_path / "healing.json", bundle, steps=STEPS, chunk=CHUNK
    )
    assert _checks(bundle) == set()
    doc = json.loads((bundle / SERVING_FILE).read_text())
    setup = doc["healing"]["setup"]
    assert setup["decoder"] == "qwen3-moe" and setup["ladder_steps"] == 1024
    assert setup["ladder_orders"] == orders and setup["model_check"]["steps"] == 4
    assert doc["milestone"] == "h200-serving-model"
    g = doc["healing"]["figures"]
    # a window of 1024 steps of 8 layers after 5 warm-up steps: calls 41-8232 of the hook
    assert g["ladder_healing_samples_in_window"] == {
        "off": 0, "4096": 2, "64": 8232 // 64 - 40 // 64, "4": 8232 // 4 - 40 // 4
    }  # fmt: skip
    assert doc["healing"]["ladder_counters"]["4096"][0]["healing_samples"] == 2

    def shorter_window(d: dict[str, Any]) -> None:
        d["healing"]["setup"]["ladder_steps"] = 100

    _edit(bundle, shorter_window)
    found = _checks(bundle)
    assert found == {"serving.overhead_mismatch"}  # the window figures no longer fit


def test_persistent_ladder_counts_samples_over_all_kept_windows(tmp_path: Path) -> None:
    hooked, healing = raw_pair()
    healing["ladder"].update(steps=128, persistent=True, orders=[LADDER_ORDER] * 3)
    (tmp_path / "hooked.json").write_text(json.dumps(hooked))
    (tmp_path / "healing.json").write_text(json.dumps(healing))
    bundle = tmp_path / "h200-serving-persistent"
    _serving().publish(
        tmp_path / "hooked.json", tmp_path / "healing.json", bundle, steps=STEPS, chunk=CHUNK,
        warm_steps=0,
    )  # fmt: skip
    assert _checks(bundle) == set()
    doc = json.loads((bundle / SERVING_FILE).read_text())
    assert doc["healing"]["setup"]["ladder_persistent"] is True
    assert doc["definitions"]["ladder_healing_samples_in_window"].startswith(
        "per rung: the healing samples the timed windows hold; ladder_persistent"
    )
    g = doc["healing"]["figures"]
    # 3 kept windows of 128 steps x 8 layers after a warm-up window: calls 1025-4096 of a hook
    assert g["ladder_healing_samples_in_window"] == {"off": 0, "4096": 1, "64": 48, "4": 768}
    assert g["ladder_monitor_copies_in_window"] == {"off": 0, "4096": 0, "64": 48, "4": 768}


LADDER_ORDER = ["64", "off", "4", "4096"]
