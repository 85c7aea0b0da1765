"""A performance model calibrated on a held-out check (``mxdb model train --calibrate-on``).

The folder holds the synthetic sweep of ``test_sweep_evidence``, the model trained on it, a
check of that model's leave-one-family-out choices with synthetic timings
(``test_perfcheck_evidence``), and the model trained again with its confidence fitted on the
check; the audit trains it again from the sweep and the check.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import pytest
from bundle_edits import audit_codes, edit_claim
from test_perfcheck_evidence import publish, synthetic_points
from test_sweep_evidence import FAMILIES, TOKENS, synthetic_sweep_bundle

from mxdb.audit import CHECKS
from mxdb.costmodel import calibration
from mxdb.costmodel.model import PerfModel
from mxdb.errors import UsageError
from mxdb.evidence.perfmodel import MODEL_FILE, REPORT_FILE, check_points, write_model_bundle
from mxdb.shapes import preset_shape

pytest.importorskip("sklearn")

SWEEP = "h200-perf-sweep"
MODEL = "h200-perf-model"
CHECK = "h200-perf-check"
CALIBRATED = "h200-perf-model-calibrated"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mxdb.costmodel.train import lofo_plan

    root = tmp_path_factory.mktemp("calibrated")
    synthetic_sweep_bundle(root, SWEEP)
    write_model_bundle([root / SWEEP], root / MODEL)
    keys = json.loads((root / SWEEP / "sweep.json").read_text())["keys"]
    training = json.loads((root / MODEL / MODEL_FILE).read_text())["training"]
    plan = lofo_plan(keys, training, TOKENS)
    points = synthetic_points(plan, families=FAMILIES, tokens=TOKENS)
    publish(root, plan, points, root / MODEL, root / SWEEP, name=CHECK)
    write_model_bundle([root / SWEEP], root / CALIBRATED, calibrate_on=root / CHECK)
    return root


def _copy(folder: Path, tmp_path: Path) -> Path:
    for name in (SWEEP, MODEL, CHECK, CALIBRATED):
        shutil.copytree(folder / name, tmp_path / name)
    return tmp_path / CALIBRATED


def _doc(root: Path) -> dict:  # type: ignore[type-arg]
    return json.loads((root / MODEL_FILE).read_text())  # type: ignore[no-any-return]


def test_the_confidence_is_fitted_on_the_checks_outcomes(folder: Path) -> None:
    from mxdb.costmodel.train import lofo_plan

    root = folder / CALIBRATED
    assert audit_codes(root) == set() and audit_codes(folder / CHECK) == set()
    doc, plain = _doc(root), _doc(folder / MODEL)
    check_bytes = (folder / CHECK / "check.json").read_bytes()
    assert doc["schema_version"] == "1.2"
    assert doc["calibrated_on"] == {
        "bundle": CHECK, "sha256": hashlib.sha256(check_bytes).hexdigest()
    }  # fmt: skip
    # the forest, gate and sweep figures are the uncalibrated model's; only the maps differ
    for k in ("model", "gate", "shape_families"):
        assert doc[k] == plain[k]
    t = doc["training"]
    assert t["lofo_calibrations"] == plain["training"]["lofo_calibrations"]
    assert "calibrated_on" not in plain and "check_calibrations" not in plain["training"]
    assert "c" not in plain["calibration"]
    points = check_points(json.loads(check_bytes))
    assert len({p.family for p in points}) >= 2 and {p.family for p in points} <= set(FAMILIES)
    assert any(p.faster for p in points) and not all(p.faster for p in points)
    cal = doc["calibration"]
    assert cal == calibration.fit_gated([(p.predicted, p.faster) for p in points],
                                        doc["gate"]["min_speedup"])  # fmt: skip
    assert cal["n"] == len(points) and cal["step"] == doc["gate"]["min_speedup"]
    for fam, c in t["check_calibrations"].items():
        assert c["n"] == sum(p.family != fam for p in points)
    # a check of this model states each family's confidence from the others' outcomes
    keys = json.loads((folder / SWEEP / "sweep.json").read_text())["keys"]
    before = {(e["family"], e["tokens"], e["routing_class"]): e
              for e in lofo_plan(keys, plain["training"], TOKENS)}  # fmt: skip
    for e in lofo_plan(keys, t, TOKENS):
        was = before[(e["family"], e["tokens"], e["routing_class"])]
        assert (e["config"], e["predicted"]) == (was["config"], was["predicted"])
        if e["config"] is not None:
            want = calibration.confidence(t["check_calibrations"][e["family"]], e["agreement"],
                                          e["predicted"])  # fmt: skip
            assert e["confidence"] == want
    model = PerfModel.from_doc(doc)
    ch = model.choice(preset_shape("olmoe-1b-7b", 16), "uniform")
    if ch.config is not None:
        assert ch.confidence == calibration.confidence(cal, ch.agreement, ch.predicted)
    assert f"held-out check {CHECK}" in (root / REPORT_FILE).read_text()


def test_training_refuses_a_check_of_other_choices(folder: Path, tmp_path: Path) -> None:
    from mxdb.costmodel.train import train

    root = _copy(folder, tmp_path)
    with pytest.raises(UsageError, match="not trained on: qwen3-30b-a3b"):
        write_model_bundle([tmp_path / SWEEP], tmp_path / "m", exclude=["qwen3-30b-a3b"],
                           calibrate_on=tmp_path / CHECK)  # fmt: skip
    with pytest.raises(UsageError, match="not a held-out check"):
        write_model_bundle([tmp_path / SWEEP], tmp_path / "m", calibrate_on=tmp_path / SWEEP)
    with pytest.raises(UsageError, match="model bundle's folder"):
        write_model_bundle([tmp_path / SWEEP], tmp_path / "m", calibrate_on=folder / CHECK)
    assert not (tmp_path / "m").exists()
    keys = json.loads((tmp_path / SWEEP / "sweep.json").read_text())["keys"]
    points = check_points(json.loads((tmp_path / CHECK / "check.json").read_text()))
    moved = [dataclasses.replace(points[0], predicted=points[0].predicted * 1.01), *points[1:]]
    with pytest.raises(UsageError, match="did not time this model's"):
        train(keys, check=moved)
    assert root.exists()


@pytest.mark.parametrize(
    ("what", "edit", "code"),
    [
        ("coefficient", lambda d: d["calibration"].__setitem__("c", d["calibration"]["c"] * 1.01),
         "perfmodel.calibration_mismatch"),
        ("step", lambda d: d["calibration"].__setitem__("step", 1.0),
         "perfmodel.calibration_mismatch"),
        ("per-family count", lambda d: next(iter(
            d["training"]["check_calibrations"].values())).__setitem__("n", 1),
         "perfmodel.calibration_mismatch"),
        ("check hash", lambda d: d["calibrated_on"].__setitem__("sha256", "0" * 64),
         "perfmodel.check_mismatch"),
        ("check folder", lambda d: d["calibrated_on"].__setitem__("bundle", SWEEP),
         "perfmodel.check_missing"),
        ("sweep-calibrated claim", lambda d: d.pop("calibrated_on"),
         "perfmodel.calibration_mismatch"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)  # fmt: skip
def test_every_kind_of_edit_is_a_finding(
    folder: Path, tmp_path: Path, what: str, edit: object, code: str
) -> None:
    root = _copy(folder, tmp_path)
    edit_claim(root, MODEL_FILE, edit)  # type: ignore[arg-type]
    assert code in audit_codes(root)
    assert code in CHECKS


def test_an_edited_or_missing_check_is_a_finding(folder: Path, tmp_path: Path) -> None:
    root = _copy(folder, tmp_path)
    original = (tmp_path / CHECK / "check.json").read_bytes()

    def flip(d: dict) -> None:  # type: ignore[type-arg]
        p = next(p for p in d["points"] if p["outcome"] == "faster")
        p["outcome"] = "same"

    edit_claim(tmp_path / CHECK, "check.json", flip)
    assert audit_codes(root) == {"perfmodel.check_mismatch"}
    # the model's reference follows the edit: training again gives other maps
    sha = hashlib.sha256((tmp_path / CHECK / "check.json").read_bytes()).hexdigest()
    edit_claim(root, MODEL_FILE, lambda d: d["calibrated_on"].__setitem__("sha256", sha))
    assert audit_codes(root) == {"perfmodel.calibration_mismatch"}

    def other_choice(d: dict) -> None:  # type: ignore[type-arg]
        e = next(p["plan_entry"] for p in d["points"] if p["candidate_speedup"] is not None)
        e["predicted"] *= 1.01

    (tmp_path / CHECK / "check.json").write_bytes(original)
    edit_claim(tmp_path / CHECK, "check.json", other_choice)
    sha = hashlib.sha256((tmp_path / CHECK / "check.json").read_bytes()).hexdigest()
    edit_claim(root, MODEL_FILE, lambda d: d["calibrated_on"].__setitem__("sha256", sha))
    assert audit_codes(root) == {"perfmodel.check_mismatch"}  # not this model's choices
    shutil.rmtree(tmp_path / CHECK)
    assert audit_codes(root) == {"perfmodel.check_missing"}


def test_without_scikit_learn_the_counts_are_still_checked(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mxdb.audit import perfmodel

    monkeypatch.setattr(perfmodel, "has_sklearn", lambda: False)
    root = _copy(folder, tmp_path)
    assert audit_codes(root) == set()
    edit_claim(root, MODEL_FILE, lambda d: next(iter(
        d["training"]["check_calibrations"].values())).__setitem__("n", 1))  # fmt: skip
    assert audit_codes(root) == {"perfmodel.calibration_mismatch"}


def test_the_cli_calibrates_on_a_check_and_names_a_bad_one(folder: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from mxdb.cli.app import cli

    _copy(folder, tmp_path)
    out = tmp_path / "m"
    args = ["model", "train", str(tmp_path / SWEEP), "--out", str(out), "--json"]
    res = CliRunner().invoke(cli, [*args, "--calibrate-on", str(tmp_path / CHECK)])
    assert res.exit_code == 0, res.output
    assert _doc(out)["calibrated_on"]["bundle"] == CHECK
    assert audit_codes(out) == set()
    bad = CliRunner().invoke(cli, [*args[:3], "--out", str(tmp_path / "m2"),
                                   "--calibrate-on", str(tmp_path / SWEEP)])  # fmt: skip
    assert bad.exit_code == 2 and "not a held-out check" in bad.output
    assert not (tmp_path / "m2").exists()
