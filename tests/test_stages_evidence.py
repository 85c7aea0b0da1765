"""Stage-profile evidence (``stages.json``): publish from raw output, audit, tampering findings."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
from benchmark_scripts import load
from bundle_edits import audit_codes, edit_claim

from mxdb.audit import CHECKS, audit_paths
from mxdb.evidence.stages import STAGES, touched_experts
from mxdb.evidence.writer import write_manifest
from mxdb.fingerprint import H200
from mxdb.shapes import memory_floor_bytes

REPO = Path(__file__).resolve().parent.parent
FP = {k: v for k, v in H200.items() if k != "mxdb"}
GEMM = {"block_m": 16, "block_n": 64, "block_k": 128, "group_m": 1, "num_warps": 4}
CFG = {"gemm1": {**GEMM, "num_stages": 3}, "gemm2": {**GEMM, "num_stages": 3}, "align_block": 16}


def _published(factory: pytest.TempPathFactory, raw: dict[str, Any], name: str) -> Path:
    """The bundle ``benchmarks/stage_profile.py publish`` writes from ``raw``."""
    root = factory.mktemp(name)
    (root / "raw.json").write_text(json.dumps(raw))
    return Path(load("stage_profile.py").publish(root / "raw.json", root / name))


def _raw() -> dict[str, Any]:
    """A small stage_profile.py raw output: Mixtral M=1 uniform (no align stage) and Qwen3-30B-A3B
    M=64 Zipf."""
    rng = random.Random(5)

    def s(center: float) -> list[float]:
        return [center * (1 + rng.uniform(-0.01, 0.01)) for _ in range(10)]

    points = []
    for fam, m, kind, params, align in (
        ("mixtral-8x7b", 1, "uniform", {}, None),
        ("qwen3-30b-a3b", 64, "zipf", {"s": 1.2}, 5.0),
    ):
        samples = {"gemm1": s(120.0), "activation": s(2.0), "gemm2": s(60.0), "sum": s(2.0)}
        samples["align"] = s(align) if align else []
        samples["layer"] = s(190.0 if align else 185.0)
        points.append({"family": fam, "tokens": m, "config": CFG,
                       "routing": {"kind": kind, "seed": m, "params": params},
                       "samples": samples})  # fmt: skip
    return {
        "fingerprint": FP,
        "copy_samples": [4.2e12 * (1 + rng.uniform(-0.01, 0.01)) for _ in range(20)],
        "read_samples": [4.6e12 * (1 + rng.uniform(-0.01, 0.01)) for _ in range(20)],
        "matmul_samples": [7.5e14 * (1 + rng.uniform(-0.01, 0.01)) for _ in range(20)],
        "points": points,
        "errors": [],
    }


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _published(tmp_path_factory, _raw(), "h200-stages")


def _audit(path: Path) -> list[Any]:
    return list(audit_paths([path]).findings)


def test_published_bundle_audits_clean_with_figures_from_the_samples(bundle: Path) -> None:
    assert _audit(bundle) == []
    doc = json.loads((bundle / "stages.json").read_text())
    p0, p1 = doc["points"]
    assert p0["samples"]["align"] == [] and p0["median_us"]["align"] == 0.0
    assert sum(p0["share"][s] for s in STAGES) == pytest.approx(1.0)
    assert p1["gemm_share"] == pytest.approx(180 / 189, rel=0.02)
    # the touched experts come from the regenerated routing, the floor from their weights
    assert p0["active_experts"] == 2
    assert 8 < p1["active_experts"] == touched_experts(p1["routing"], 64, 128, 8) < 128
    bw = doc["bandwidth"]["copy_bytes_per_s"]
    floor = memory_floor_bytes(p1["active_experts"], 2048, 768, "bf16") / bw * 1e6
    assert p1["floor_us_copy"] == pytest.approx(floor)
    assert p1["floor_fraction_copy"] == pytest.approx(floor / p1["median_us"]["layer"])
    compute = 6 * 64 * 8 * 2048 * 768 / doc["bandwidth"]["matmul_flops_per_s"] * 1e6
    assert p1["compute_floor_us"] == pytest.approx(compute)
    assert p1["bound_fraction"] == pytest.approx(max(floor, compute) / p1["median_us"]["layer"])
    assert doc["figures"]["n_decode_uniform"] == 1 and doc["figures"]["n_large_skewed"] == 1
    assert (bundle / "report" / "stages.md").read_text().startswith("# Where the fused MoE")


@pytest.mark.parametrize(
    ("edit", "code"),
    [
        (lambda d: d["points"][1]["median_us"].__setitem__("gemm1", 99.0), "stages.median_mismatch"),
        (lambda d: d["points"][1].__setitem__("active_experts", 3), "stages.figure_mismatch"),
        (lambda d: d["points"][1]["routing"].__setitem__("seed", 7), "stages.figure_mismatch"),
        (lambda d: d["points"][0]["share"].__setitem__("sum", 0.5), "stages.figure_mismatch"),
        (lambda d: d["points"][0]["samples"]["layer"].__setitem__(0, -1.0), "stages.sample_invalid"),
        (lambda d: d["points"][0]["samples"].__setitem__("gemm1", []), "stages.sample_invalid"),
        (lambda d: d["points"][0]["shape"].__setitem__("hidden", 1024), "stages.shape_mismatch"),
        (lambda d: d["points"][0].__setitem__("config_hash", "0" * 16), "stages.config_hash_mismatch"),
        (lambda d: d["bandwidth"].__setitem__("copy_bytes_per_s", 9e12), "stages.bandwidth_mismatch"),
        (lambda d: d["points"][1].__setitem__("bound_fraction", 0.99), "stages.figure_mismatch"),
        (lambda d: d["figures"].__setitem__("all_geomean_gemm_share", 0.5), "stages.geomean_mismatch"),
        (lambda d: d.__setitem__("decode_max_tokens", 32), "stages.field_mismatch"),
        (lambda d: d.__setitem__("fingerprint_hash", "0" * 16), "stages.fingerprint_mismatch"),
    ],
)  # fmt: skip
def test_every_kind_of_edit_is_a_finding(
    bundle: Path, tmp_path: Path, edit: Any, code: str
) -> None:
    assert code in _edited(bundle, tmp_path, edit)
    assert code in CHECKS


def _edited(bundle: Path, tmp_path: Path, edit: Any) -> set[str]:
    """The finding codes of a copy of ``bundle`` whose ``stages.json`` ``edit`` changed (its
    report re-rendered and its manifest re-written, as a careful forger would)."""
    dst = tmp_path / "b"
    shutil.copytree(bundle, dst)
    edit_claim(dst, "stages.json", edit)
    return audit_codes(dst)


def test_an_edited_report_is_a_finding(bundle: Path, tmp_path: Path) -> None:
    dst = tmp_path / "b"
    shutil.copytree(bundle, dst)
    md = dst / "report" / "stages.md"
    md.write_text(md.read_text().replace("| mixtral-8x7b | 1 |", "| mixtral-8x7b | 2 |"))
    write_manifest(dst, bundle_id="h200-stages", milestone="h200-stages")
    (f,) = [f for f in _audit(dst) if f.check == "stages.report_mismatch"]
    assert f.file.endswith("report/stages.md") and f.field.startswith("line ")


def _dispatch_raw() -> dict[str, Any]:
    """A ``--dispatch`` raw output: a fused_act point and a fused_slice point (its one kernel
    timed as ``fused``, its cast launch as ``sum``)."""
    raw = _raw()
    act = {**CFG, "impl": "fused_act"}
    gemm = {**GEMM, "num_stages": 3}
    sliced = {"gemm1": gemm, "gemm2": {**gemm, "block_n": 128, "block_k": 64},
              "align_block": 16, "impl": "fused_slice"}  # fmt: skip
    p0, p1 = raw["points"]
    p0["config"], p0["dispatch_reason"] = sliced, "exact_match"
    p0["samples"] = {k: p0["samples"][k] for k in ("align", "layer")} | {
        "fused": [150.0] * 10,
        "sum": [2.0] * 10,
    }
    p1["config"], p1["dispatch_reason"] = act, "parity"
    del p1["samples"]["activation"]
    raw["config_source"] = "dispatch"
    return raw


@pytest.fixture(scope="module")
def dispatch_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _published(tmp_path_factory, _dispatch_raw(), "h200-stages-dispatch")


def test_a_dispatch_profile_times_each_implementations_own_stages(dispatch_bundle: Path) -> None:
    assert _audit(dispatch_bundle) == []
    doc = json.loads((dispatch_bundle / "stages.json").read_text())
    assert doc["schema_version"] == "1.1" and doc["config_source"] == "dispatch"
    p0, p1 = doc["points"]
    assert (p0["impl"], p0["dispatch_reason"]) == ("fused_slice", "exact_match")
    assert (p1["impl"], p1["dispatch_reason"]) == ("fused_act", "parity")
    # fused_slice: the one kernel counts as GEMM time; the stages it lacks weigh 0
    assert p0["median_us"]["gemm1"] == p0["median_us"]["activation"] == 0.0
    assert p0["gemm_share"] == pytest.approx(150 / 152)
    assert p0["gemm_floor_fraction_copy"] == pytest.approx(p0["floor_us_copy"] / 150)
    assert p1["median_us"]["activation"] == 0.0 and p1["median_us"]["fused"] == 0.0
    report = (dispatch_bundle / "report" / "stages.md").read_text()
    assert report.startswith("# Where the fused MoE layer's GPU time goes: mxdb's dispatch")
    assert "| fused_slice |" in report and "| exact_match |" in report


@pytest.mark.parametrize(
    ("edit", "code"),
    [
        # a stage fused_slice does not have, given samples
        (lambda d: d["points"][0]["samples"].__setitem__("gemm1", [1.0] * 10), "stages.sample_invalid"),
        # fused_slice's own kernel without samples
        (lambda d: d["points"][0]["samples"].__setitem__("fused", []), "stages.sample_invalid"),
        (lambda d: d["points"][1].__setitem__("impl", "flaggems"), "stages.field_mismatch"),
        (lambda d: d["points"][0]["median_us"].__setitem__("fused", 10.0), "stages.median_mismatch"),
        (lambda d: d["points"][0].__setitem__("gemm_share", 0.5), "stages.figure_mismatch"),
    ],
)  # fmt: skip
def test_edits_of_a_dispatch_profile_are_findings(
    dispatch_bundle: Path, tmp_path: Path, edit: Any, code: str
) -> None:
    assert code in _edited(dispatch_bundle, tmp_path, edit)


def test_the_committed_schema_1_0_profile_still_audits_clean() -> None:
    bundle = REPO / "evidence" / "h200-stages"
    assert json.loads((bundle / "stages.json").read_text())["schema_version"] == "1.0"
    assert _audit(bundle) == []


def test_stage_groups_split_each_implementations_launches() -> None:
    mod = load("stage_profile.py")
    steps = ["memset", "s1", "s2", "g1", "act", "g2", "sum"]
    assert mod.stage_groups("flaggems", steps) == {
        "align": ["memset", "s1", "s2"], "gemm1": ["g1"], "activation": ["act"],
        "gemm2": ["g2"], "sum": ["sum"],
    }  # fmt: skip
    assert mod.stage_groups("fused_act", ["g1a", "g2", "sum"]) == {
        "align": [], "gemm1": ["g1a"], "gemm2": ["g2"], "sum": ["sum"],
    }  # fmt: skip
    assert mod.stage_groups("fused_slice", ["one", "fused", "cast"]) == {
        "align": ["one"], "fused": ["fused"], "sum": ["cast"],
    }  # fmt: skip
