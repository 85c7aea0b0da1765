"""Compile-survey evidence: the bundle, the proxy figures, and the audit's findings on tampering."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mxdb.audit import CHECKS, audit_paths
from mxdb.errors import EvidenceError
from mxdb.evidence.files import dumps
from mxdb.evidence.survey import SURVEY_FILE, build_survey, write_survey_bundle
from mxdb.evidence.writer import write_manifest
from mxdb.profiles import get_profile
from mxdb.resources import VLLM_GRID

REPO = Path(__file__).resolve().parent.parent
COMMITTED = REPO / "evidence" / "h200-compile-survey"

#: A small grid that holds each status: compile_error (M256/N64/K64/w4), oor (stage 5), ok.
SMALL_AXES = {
    "block_m": [64, 256],
    "block_n": [64, 128],
    "block_k": [64],
    "group_m": [1, 16],
    "num_warps": [4, 8],
    "num_stages": [2, 5],
}


def _raw_from_committed() -> dict[str, Any]:
    """A gpu_survey.py-style survey rebuilt from the committed bundle's raw compile records."""
    doc = json.loads((COMMITTED / SURVEY_FILE).read_text())
    results = []
    for c in doc["compiles"]:
        r = {k: c[k] for k in ("block_m", "block_n", "block_k", "num_warps", "num_stages")}
        r.update(status=c["status"], error=c["error"], shared=c["smem_bytes"])
        r.update(n_regs=c["n_regs"], n_spills=c["n_spills"], seconds=c["seconds"])
        if c["status"] == "oor":
            r.update(required=c["smem_required"], limit=c["smem_limit"], resource=c["resource"])
        results.append(r)
    controls = [
        {
            "tuple": [c[k] for k in ("block_m", "block_n", "block_k", "num_warps", "num_stages")],
            "group_m": c["group_m"],
            "same_as_group1": c["same_as_group1"],
            "status": c["status"],
            "shared": c["smem_bytes"],
            "n_regs": c["n_regs"],
            "n_spills": c["n_spills"],
        }
        for c in doc["group_m_control"]
    ]
    s = doc["shape"]
    return {
        "what": "test survey",
        "gemm": {
            "N": 2 * s["intermediate"],
            "K": s["hidden"],
            "E": s["experts"],
            "topk": s["topk"],
            "tokens": s["tokens"],
        },
        "environment": doc["fingerprint"],
        "results": results,
        "group_m_control": controls,
    }


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    return _raw_from_committed()


def _bundle(tmp_path: Path, raw: dict[str, Any], **kw: Any) -> Path:
    survey = build_survey(raw, axes=SMALL_AXES, grid_name="small", milestone="test-survey", **kw)
    return write_survey_bundle(tmp_path / "b", survey, bundle_id="test-survey-1")


def _tamper(root: Path, edit: Any, *, rehash: bool = True) -> None:
    path = root / SURVEY_FILE
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_bytes(dumps(doc))
    if rehash:  # a tamperer who rewrites the manifest too: only the semantics can catch it
        write_manifest(root, bundle_id="test-survey-1", milestone="test-survey")


def _checks(root: Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for f in audit_paths([root]).findings:
        assert f.check in CHECKS, f
        found.setdefault(f.check, []).append(f.field)
    return found


def test_small_survey_is_clean_and_its_figures_are_right(tmp_path: Path, raw: dict) -> None:
    root = _bundle(tmp_path, raw)
    assert sorted(p.name for p in root.iterdir()) == [
        "fingerprint.json",
        "manifest.json",
        "survey.json",
    ]
    assert audit_paths([root]).ok
    doc = json.loads((root / SURVEY_FILE).read_text())
    c = doc["claims"]
    assert doc["schema"] == "mxdb.compile-survey" and doc["schema_version"] == "1.1"
    assert c["grid_configs"] == 32 and c["distinct_compiles"] == 16
    # M256/N64/K64/w4 fails to compile at both stages, for both GROUP_SIZE_M values
    assert c["by_failure_kind"]["compile_error"] == {
        "configs": 4,
        "proxy_rejected": 4,
        "proxy_rejected_fraction": 1.0,
    }
    assert c["by_status"]["ok"] + c["failures"] == 32
    assert c["proxy_rejected_ok"] == 0 and c["meets_threshold"] is True
    # the compile errors fit the device: only the measured known-failure rule rejects them
    assert c["resource_rules_only"]["proxy_rejected"] == c["failures"] - 4
    known = [r for r in doc["rows"] if r["known_failure"]]
    assert len(known) == 4 and all(r["status"] == "compile_error" for r in known)
    assert {(r["config"]["block_m"], r["config"]["num_warps"]) for r in known} == {(256, 4)}


def test_edited_claim_is_a_count_mismatch(tmp_path: Path, raw: dict) -> None:
    root = _bundle(tmp_path, raw)
    _tamper(root, lambda d: d["claims"]["by_status"].__setitem__("ok", 999))
    found = _checks(root)
    assert found == {"survey.count_mismatch": ["claims.by_status.ok"]}


def test_edit_without_rehash_is_caught_by_the_manifest_too(tmp_path: Path, raw: dict) -> None:
    root = _bundle(tmp_path, raw)
    _tamper(root, lambda d: d["claims"].__setitem__("failures", 0), rehash=False)
    found = _checks(root)
    assert "manifest.changed" in found and found["survey.count_mismatch"] == ["claims.failures"]


def test_edited_raw_status_is_caught(tmp_path: Path, raw: dict) -> None:
    root = _bundle(tmp_path, raw)

    def edit(d: dict) -> None:
        i = next(i for i, c in enumerate(d["compiles"]) if c["status"] == "oor")
        d["compiles"][i]["status"] = "ok"

    _tamper(root, edit)
    found = _checks(root)
    # the grid rows still say oor, the record lacks a compiled kernel's resources, the proxy
    # now rejects a config that "compiled", and the claimed counts are no longer the rows'
    assert {
        "survey.status_mismatch",
        "survey.record_invalid",
        "survey.false_rejection",
        "survey.count_mismatch",
        "survey.claim_mismatch",
    } <= set(found)
    assert "claims.distinct_by_status.ok" in found["survey.count_mismatch"]
    assert "claims.proxy_rejected_ok" in found["survey.claim_mismatch"]


def test_removed_config_is_an_incomplete_grid(tmp_path: Path, raw: dict) -> None:
    root = _bundle(tmp_path, raw)
    _tamper(root, lambda d: d["rows"].pop(5))
    found = _checks(root)
    assert found["survey.grid_incomplete"] == ["rows"]
    assert "claims.grid_configs" in found["survey.count_mismatch"]


def test_inflated_proxy_claim_is_caught(tmp_path: Path, raw: dict) -> None:
    root = _bundle(tmp_path, raw)

    def edit(d: dict) -> None:
        # claim the resource rules alone reject every failure, and hide a rejection row
        rr = d["claims"]["resource_rules_only"]
        rr["proxy_rejected"] = rr["configs"]
        rr["proxy_rejected_fraction"] = 1.0
        row = next(r for r in d["rows"] if r["known_failure"])
        row["known_failure"] = None

    _tamper(root, edit)
    found = _checks(root)
    assert set(found) == {"survey.claim_mismatch", "survey.proxy_mismatch"}
    assert sorted(found["survey.claim_mismatch"]) == [
        "claims.resource_rules_only.proxy_rejected",
        "claims.resource_rules_only.proxy_rejected_fraction",
    ]
    assert found["survey.proxy_mismatch"][0].endswith(".known_failure")


def test_a_flipped_verdict_and_a_wrong_control_flag_are_caught(tmp_path: Path, raw: dict) -> None:
    root = _bundle(tmp_path, raw)

    def edit(d: dict) -> None:
        d["rows"][0]["proxy_rejects"] = not d["rows"][0]["proxy_rejects"]
        d["group_m_control"].append({**d["group_m_control"][0], "same_as_group1": False})

    doc = json.loads((root / SURVEY_FILE).read_text())
    if not doc["group_m_control"]:
        pytest.skip("no GROUP_SIZE_M control falls in the small grid")
    _tamper(root, edit)
    found = _checks(root)
    assert found["survey.proxy_mismatch"] == ["rows[0].proxy_rejects"]
    assert found["survey.group_control_mismatch"][0].endswith(".same_as_group1")


def test_a_proxy_below_the_threshold_is_a_finding(tmp_path: Path, raw: dict) -> None:
    # a profile that claims far more shared memory than the H200 has: the oor configs pass
    roomy = get_profile("h200").model_copy(update={"smem_per_block": 4 * 1024 * 1024})
    root = _bundle(tmp_path, raw, profile=roomy)
    doc = json.loads((root / SURVEY_FILE).read_text())
    assert doc["claims"]["meets_threshold"] is False
    found = _checks(root)
    assert found["survey.below_threshold"] == ["claims.proxy_rejected_failures_fraction"]
    assert found["survey.profile_mismatch"] == ["profile.smem_per_block"]


def test_builder_refuses_an_incomplete_survey(tmp_path: Path, raw: dict) -> None:
    partial = {**raw, "results": raw["results"][:-1]}
    with pytest.raises(EvidenceError, match="lacks 1 compilations"):
        build_survey(partial)
    survey = build_survey(raw, axes=SMALL_AXES, grid_name="small")
    (tmp_path / "x").write_text("not a bundle")
    with pytest.raises(EvidenceError, match="not an empty directory"):
        write_survey_bundle(tmp_path, survey)


def test_committed_bundle_passes_the_audit_and_meets_the_claim() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mxdb", "audit", str(COMMITTED)],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((COMMITTED / SURVEY_FILE).read_text())
    c = doc["claims"]
    assert doc["grid"]["axes"] == {k: list(v) for k, v in VLLM_GRID.items()}
    assert c["grid_configs"] == 1920 and c["distinct_compiles"] == 480
    assert c["by_status"] == {"compile_error": 48, "ok": 1284, "oor": 588}
    assert c["failures"] == 636 and c["proxy_rejected_ok"] == 0
    assert c["proxy_rejected_failures_fraction"] >= 0.95 and c["meets_threshold"] is True
    assert c["resource_failures"]["proxy_rejected_fraction"] == 1.0
    assert doc["fingerprint"]["triton"] == "3.6.0" and doc["fingerprint"]["mxdb"] is None
    assert all(ctl["same_as_group1"] for ctl in doc["group_m_control"])


def test_proxy_accuracy_script_reports_the_committed_figures() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "proxy_accuracy.py"), "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["audit_ok"] is True and out["claims"]["failures"] == 636
