"""The audit of a tuning-cost bundle: figures recomputed from its raw files, tampering caught."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mxdb.audit.checks import audit_bundle
from mxdb.evidence.writer import write_manifest

BUNDLE = Path(__file__).resolve().parents[1] / "evidence" / "h200-tuning-cost"


@pytest.fixture()
def bundle(tmp_path: Path) -> Path:
    if not (BUNDLE / "tuning_cost.json").is_file():
        pytest.skip("no committed tuning-cost bundle")
    dst = tmp_path / "b"
    shutil.copytree(BUNDLE, dst)
    return dst


def _reseal(root: Path) -> None:
    m = json.loads((root / "manifest.json").read_text())
    (root / "manifest.json").unlink()
    write_manifest(root, bundle_id=m["bundle_id"], milestone=m["milestone"])


def _checks(root: Path) -> set[str]:
    return {f.check for f in audit_bundle(root).findings}


def test_committed_bundle_audits_clean(bundle: Path) -> None:
    assert audit_bundle(bundle).findings == ()
    doc = json.loads((bundle / "tuning_cost.json").read_text())
    for p in doc["points"]:
        # the exhaustive side timed the whole grid that fits, each GEMM on its own
        assert p["exhaustive_configs_timed"] > 2000
        assert 0 < p["gpu_time_fraction"] < 1


def test_edited_quality_ratio_is_a_finding(bundle: Path) -> None:
    path = bundle / "tuning_cost.json"
    doc = json.loads(path.read_text())
    doc["points"][0]["quality_ratio"] = 1.0
    doc["points"][0]["meets_target"] = True
    doc["summary"]["meeting_target"] += 1
    path.write_text(json.dumps(doc))
    _reseal(bundle)
    assert "tuning_cost.mismatch" in _checks(bundle)


def test_edited_gpu_time_is_a_finding(bundle: Path) -> None:
    path = bundle / "tuning_cost.json"
    doc = json.loads(path.read_text())
    doc["points"][1]["exhaustive"]["time_call_wall_s"].append(100.0)
    path.write_text(json.dumps(doc))
    _reseal(bundle)
    assert "tuning_cost.mismatch" in _checks(bundle)


def test_sweep_whose_best_is_not_the_timed_run_is_a_finding(bundle: Path) -> None:
    path = bundle / "sweeps" / "p0-gemm1.json"
    doc = json.loads(path.read_text())
    rows = [r for r in doc["timed"] if r["status"] == "ok" and r["samples_us"]]
    slowest = max(rows, key=lambda r: sorted(r["samples_us"])[len(r["samples_us"]) // 2])
    slowest["samples_us"] = [0.001 for _ in slowest["samples_us"]]
    path.write_text(json.dumps(doc))
    _reseal(bundle)
    assert "tuning_cost.sweep_best" in _checks(bundle)


def test_missing_run_is_a_finding(bundle: Path) -> None:
    path = bundle / "tuning_cost.json"
    doc = json.loads(path.read_text())
    doc["points"][2]["runs"]["mxdb"] = "no-such-run"
    path.write_text(json.dumps(doc))
    _reseal(bundle)
    assert "tuning_cost.missing_run" in _checks(bundle)
