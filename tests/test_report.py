"""``mxdb report``: Markdown, JSON and PNG plots from a bundle's raw samples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import mxdb.cli  # noqa: F401
from mxdb.cli.app import cli
from mxdb.evidence.synthetic import synthetic_bundle
from mxdb.report import build_report


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic_bundle(
        tmp_path_factory.mktemp("r") / "b", groups=6, runs_per_group=8, failure_rate=0.3, seed=4
    )


def test_report_writes_markdown_json_and_plots(bundle: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["report", str(bundle), "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    files = {Path(p).name for p in json.loads(res.stdout)["files"]}
    assert files == {"report.md", "report.json", "speedup_vs_m.png", "floor_fraction_vs_m.png"}
    for png in ("speedup_vs_m.png", "floor_fraction_vs_m.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rep = json.loads((out / "report.json").read_text())
    summary = json.loads((bundle / "summary.json").read_text())
    assert rep == build_report(summary)
    assert rep == json.loads((bundle / "report" / "report.json").read_text())
    md = (out / "report.md").read_text()
    for f in summary["failures"]:  # nothing hidden
        assert f["run_id"] in md
    assert len(rep["rows"]) == 6 and md.count("| yes |") + md.count("| no |") == 6


def test_report_without_plots_and_missing_summary(bundle: Path, tmp_path: Path) -> None:
    res = CliRunner().invoke(
        cli, ["report", str(bundle), "--out", str(tmp_path / "o"), "--no-plots"]
    )
    assert res.exit_code == 0
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["report.json", "report.md"]
    res = CliRunner().invoke(cli, ["report", str(tmp_path), "--out", str(tmp_path / "p")])
    assert res.exit_code == 1 and "no summary.json" in res.stderr


def test_speedup_low_is_speedup_over_noise(bundle: Path) -> None:
    rep = json.loads((bundle / "report" / "report.json").read_text())
    for r in rep["rows"]:
        if r["speedup"] is not None and r["noise_band"] is not None:
            assert r["speedup_low"] == pytest.approx(r["speedup"] / (1 + r["noise_band"]))
