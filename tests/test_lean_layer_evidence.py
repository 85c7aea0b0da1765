"""Lean-layer evidence (``lean_layer.json``): publish from raw output, audit, tampering findings."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
from benchmark_scripts import load
from bundle_edits import audit_codes, edit_claim

from mxdb.audit import audit_paths
from mxdb.evidence import stats
from mxdb.evidence.lean_layer import TARGETS
from mxdb.evidence.peers import judge
from mxdb.evidence.writer import write_manifest
from mxdb.fingerprint import H200

REPO = Path(__file__).resolve().parent.parent
COMMITTED = REPO / "evidence" / "h200-lean-layer"

# the recorded H200 host (mxdb.fingerprint), as a raw output that did not record mxdb's version
FP = {k: v for k, v in H200.items() if k != "mxdb"}
GEMM = {"block_m": 16, "block_n": 128, "block_k": 128, "group_m": 16, "num_warps": 4}
CFG = {"gemm1": {**GEMM, "num_stages": 5}, "gemm2": {**GEMM, "num_stages": 4}, "align_block": 16}


def _publish() -> Any:
    mod = load("lean_layer.py")
    return mod.publish


def _s(rng: random.Random, center: float, n: int = 9) -> list[float]:
    return [center * (1 + rng.uniform(-0.01, 0.01)) for _ in range(n)]


def _raw() -> dict[str, Any]:
    """A small lean_layer.py raw output: decode points M=1, 4 and one larger point M=64."""
    rng = random.Random(3)
    points = []
    for m, graph in ((1, 180.0), (4, 420.0), (64, 900.0)):
        points.append(
            {
                "family": "mixtral-8x7b",
                "tokens": m,
                "config": CFG,
                "config_is_flaggems": False,
                "launches": 4,
                "record_error": None,
                "correct": [0.01, 0.004, True],
                "identical_to_fused_experts_impl": None,
                "graph_us": _s(rng, graph),
                "eager_us": {
                    "layer": _s(rng, graph * 1.03),
                    "fused_experts_impl": _s(rng, graph * 1.4),
                    "layer_graphs": _s(rng, graph * 1.05),
                    "pipeline": _s(rng, graph * 1.02),
                },
                "synced_us": {
                    "layer": _s(rng, graph * 1.1),
                    "fused_experts_impl": _s(rng, graph * 2.3),
                    "layer_graphs": _s(rng, graph * 1.2),
                },
                "host_us": {
                    "layer": 22.0,
                    "fused_experts_impl": 370.0,
                    "layer_graphs": 23.0,
                    "pipeline": 200.0,
                },
            }
        )
    return {"fingerprint": FP, "points": points, "profile": {"mixtral-8x7b": "a table\n"}}


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lean")
    raw = root / "raw.json"
    raw.write_text(json.dumps(_raw()))
    _publish()(raw, root / "h200-lean-layer")
    return root / "h200-lean-layer"


@pytest.fixture
def bundle(published: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "h200-lean-layer"
    shutil.copytree(published, dst)
    return dst


def test_published_bundle_passes_and_holds_every_figure(published: Path) -> None:
    assert audit_codes(published) == set()
    doc = json.loads((published / "lean_layer.json").read_text())
    assert doc["schema"] == "mxdb.lean-layer" and doc["schema_version"] == "1.0"
    f = doc["figures"]
    assert (f["n_points"], f["n_decode_points"]) == (3, 2)
    p = doc["points"][0]
    s = p["samples"]
    assert p["eager_over_graph_layer"] == stats.median(s["eager_layer"]) / stats.median(
        s["graph_layer"]
    )
    assert p["host_speedup_layer_over_fused_experts_impl"] == 370.0 / 22.0
    assert {t["name"] for t in doc["targets"]} == {t.name for t in TARGETS}
    for t in doc["targets"]:
        assert t["passed"] is judge(t["comparison"], t["measured"], t["threshold"])
    fp = json.loads((published / "fingerprint.json").read_text())
    assert fp["fingerprint"]["mxdb"] is None  # the environment the raw output recorded
    assert doc["fingerprint_hash"] == fp["hash"]


def test_tampered_sample_is_found(bundle: Path) -> None:
    def bump(doc: dict[str, Any]) -> None:
        doc["points"][1]["samples"]["eager_layer"] = [
            x * 0.5 for x in doc["points"][1]["samples"]["eager_layer"]
        ]

    edit_claim(bundle, "lean_layer.json", bump)
    checks = audit_codes(bundle)
    assert {"lean_layer.median_mismatch", "lean_layer.ratio_mismatch"} <= checks
    assert "lean_layer.geomean_mismatch" in checks


def test_invalid_sample_is_found(bundle: Path) -> None:
    def negate(doc: dict[str, Any]) -> None:
        doc["points"][0]["samples"]["synced_layer"][2] = -1.0

    edit_claim(bundle, "lean_layer.json", negate)
    assert audit_codes(bundle) == {"lean_layer.sample_invalid"}


def test_tampered_ratio_is_found(bundle: Path) -> None:
    def shrink(doc: dict[str, Any]) -> None:
        doc["points"][2]["eager_over_graph_layer"] = 1.0

    edit_claim(bundle, "lean_layer.json", shrink)
    res = audit_paths([bundle])
    assert {f.check for f in res.findings} == {"lean_layer.ratio_mismatch"}
    assert res.findings[0].field == "points[2].eager_over_graph_layer"


def test_pass_claimed_for_missed_target_is_found(bundle: Path) -> None:
    def tighten(doc: dict[str, Any]) -> None:
        # the measured decode eager/graph (~1.03) against a 1.10 ceiling passes; claim a miss
        t = next(t for t in doc["targets"] if t["name"] == "decode_eager_near_graph")
        assert t["passed"] is True
        t["passed"] = False

    edit_claim(bundle, "lean_layer.json", tighten)
    assert audit_codes(bundle) == {"lean_layer.target_verdict_mismatch"}


def test_pass_for_a_missed_target_after_inflating_the_figure(bundle: Path) -> None:
    def cheat(doc: dict[str, Any]) -> None:
        for p in doc["points"]:
            p["samples"]["eager_layer"] = [x * 1.5 for x in p["samples"]["eager_layer"]]

    edit_claim(
        bundle, "lean_layer.json", cheat
    )  # eager is now 1.5x graph: the target is missed, yet claimed passed
    checks = audit_codes(bundle)
    assert "lean_layer.target_verdict_mismatch" in checks
    assert "lean_layer.target_measured_mismatch" in checks


def test_correctness_and_config_hash_are_rechecked(bundle: Path) -> None:
    def corrupt(doc: dict[str, Any]) -> None:
        doc["points"][0]["correctness"]["max_abs_err"] = 1.0  # over bf16's 0.0625, still "passed"
        doc["points"][1]["config"]["align_block"] = 32

    edit_claim(bundle, "lean_layer.json", corrupt)
    assert audit_codes(bundle) == {
        "lean_layer.correctness_mismatch",
        "lean_layer.config_hash_mismatch",
    }


def test_committed_bundle_passes_audit() -> None:
    assert audit_paths([COMMITTED]).findings == ()
    doc = json.loads((COMMITTED / "lean_layer.json").read_text())
    assert doc["figures"]["n_points"] == 14 and doc["figures"]["n_decode_points"] == 10
    fp = json.loads((COMMITTED / "fingerprint.json").read_text())
    assert doc["fingerprint_hash"] == fp["hash"]


def test_an_edited_report_is_a_finding(bundle: Path) -> None:
    md = bundle / "report" / "lean_layer.md"
    md.write_text(md.read_text().replace("| mixtral-8x7b | 64 |", "| mixtral-8x7b | 65 |"))
    write_manifest(bundle, bundle_id="h200-lean-layer", milestone="h200-lean-layer")
    assert audit_codes(bundle) == {"lean_layer.report_mismatch"}
