"""``mxdb audit`` through the real CLI: exit codes, JSON output, bundle discovery."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import mxdb.cli  # noqa: F401  (registers the commands)
from mxdb.audit import CHECKS, audit_paths
from mxdb.cli.app import cli
from mxdb.evidence.synthetic import synthetic_bundle


@pytest.fixture(scope="module")
def evidence(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("evidence")
    synthetic_bundle(root / "h200-m1", groups=2, runs_per_group=6, seed=1, milestone="h200-m1")
    synthetic_bundle(
        root / "nested" / "h200-m2", groups=2, runs_per_group=5, seed=2, milestone="h200-m2"
    )
    return root


def test_audit_folder_of_bundles_passes(evidence: Path) -> None:
    res = CliRunner().invoke(cli, ["audit", str(evidence), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["ok"] is True and doc["findings"] == []
    assert sorted(b["milestone"] for b in doc["bundles"]) == ["h200-m1", "h200-m2"]
    assert sum(b["runs"] for b in doc["bundles"]) == 22


def test_audit_reports_findings_and_exit_1(evidence: Path, tmp_path: Path) -> None:
    dst = tmp_path / "ev"
    shutil.copytree(evidence, dst)
    summary = dst / "h200-m1" / "summary.json"
    doc = json.loads(summary.read_text())
    doc["geomean_speedup"] = 3.0
    summary.write_text(json.dumps(doc))
    res = CliRunner().invoke(cli, ["audit", str(dst), "--json"])
    assert res.exit_code == 1
    out = json.loads(res.stdout)
    assert out["ok"] is False
    by_check = {f["check"]: f for f in out["findings"]}
    assert set(by_check) == {"manifest.changed", "summary.geomean_mismatch"}
    f = by_check["manifest.changed"]
    assert f["file"].endswith("h200-m1/summary.json") and f["field"] == "sha256"
    g = by_check["summary.geomean_mismatch"]
    assert g["field"] == "geomean_speedup" and g["found"] == "3.0"
    assert set(f) == {"check", "file", "field", "expected", "found", "message"}
    human = CliRunner().invoke(cli, ["audit", str(dst)])
    assert human.exit_code == 1
    assert "[manifest.changed]" in human.stdout and "2 finding(s)" in human.stderr


def test_folder_without_bundle_is_a_finding(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    res = CliRunner().invoke(cli, ["audit", str(tmp_path / "empty"), "--json"])
    assert res.exit_code == 1
    assert json.loads(res.stdout)["findings"][0]["check"] == "bundle.none_found"


def test_missing_path_is_a_usage_error(tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["audit", str(tmp_path / "nope")])
    assert res.exit_code == 2 and "does not exist" in res.stderr


def test_one_milestone_one_environment(evidence: Path, tmp_path: Path) -> None:
    from mxdb.evidence.synthetic import H200

    other = H200.model_copy(update={"driver": "575.1"})
    synthetic_bundle(tmp_path / "a", groups=1, runs_per_group=4, milestone="same")
    synthetic_bundle(
        tmp_path / "b", groups=1, runs_per_group=4, milestone="same", fingerprint=other
    )
    checks = [f.check for f in audit_paths([tmp_path]).findings]
    assert checks == ["bundle.milestone_fingerprint"]


def test_audit_in_a_subprocess(evidence: Path) -> None:
    code = "from mxdb.cli import main; main()"
    res = subprocess.run(
        [sys.executable, "-c", code, "audit", str(evidence)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout == "" and "ok: 2 bundle(s), 22 run(s), 0 finding(s)" in res.stderr


def test_audit_never_imports_gpu_stacks(evidence: Path) -> None:
    code = (
        "import sys; from mxdb.cli import main\n"
        "try:\n    main(['audit', sys.argv[1]])\nexcept SystemExit as e:\n    rc = e.code\n"
        "bad = [m for m in ('torch', 'triton', 'flag_gems', 'matplotlib') if m in sys.modules]\n"
        "print(rc, bad)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, str(evidence)], capture_output=True, text=True, timeout=60
    )
    assert res.stdout.strip() == "0 []", res.stderr


def test_every_check_code_is_documented() -> None:
    import re

    src = Path(__file__).parents[1] / "mxdb" / "audit" / "checks.py"
    src_text = src.read_text() + (src.parent.parent / "signing.py").read_text()
    used = set(re.findall(r'(?:add|Finding)\(\s*"([a-z_]+\.[a-z_]+)"', src_text))
    used |= set(re.findall(r'check = "([a-z_]+\.[a-z_]+)"', src_text))
    assert len(used) > 40
    assert used <= set(CHECKS), used - set(CHECKS)
