"""Performance-model evidence (``model.json``): training from sweep bundles, audit, tampering.

Most tests train on the small synthetic sweep of ``test_sweep_evidence`` (a second or two); the
last ones audit the committed model beside the committed sweep, which trains the model again
once (about half a minute; the audit keeps the result for the rest of the process).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from bundle_edits import audit_codes, edit_claim
from test_sweep_evidence import FAMILIES, FP, raw_sweep, synthetic_sweep_bundle

from mxdb.audit import CHECKS, audit_paths
from mxdb.costmodel.features import FEATURE_NAMES
from mxdb.costmodel.model import PerfModel
from mxdb.costmodel.train import GATE_GUARD
from mxdb.errors import UsageError
from mxdb.evidence.perfmodel import MODEL_FILE, REPORT_FILE, write_model_bundle
from mxdb.shapes import preset_shape

pytest.importorskip("sklearn")

EVIDENCE = Path(__file__).resolve().parents[1] / "evidence"
SWEEP = "h200-perf-sweep"
MODEL = "h200-perf-model"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with a synthetic sweep bundle and the model trained on it."""
    root = tmp_path_factory.mktemp("models")
    synthetic_sweep_bundle(root, SWEEP)
    write_model_bundle([root / SWEEP], root / MODEL)
    return root


def _copy(folder: Path, tmp_path: Path) -> Path:
    """The model and sweep bundles copied side by side; returns the model bundle."""
    for name in (SWEEP, MODEL):
        shutil.copytree(folder / name, tmp_path / name)
    return tmp_path / MODEL


def test_the_model_bundle_is_what_answering_and_the_check_read(folder: Path) -> None:
    root = folder / MODEL
    assert list(audit_paths([root]).findings) == []
    doc = json.loads((root / MODEL_FILE).read_text())
    sweep = (folder / SWEEP / "sweep.json").read_bytes()
    assert doc["sweeps"] == [{"bundle": SWEEP, "sha256": hashlib.sha256(sweep).hexdigest()}]
    assert doc["excluded"] == [] and doc["feature_names"] == list(FEATURE_NAMES)
    assert doc["shape_families"] == sorted(preset_shape(f, 1).family for f in FAMILIES)
    assert doc["fingerprint_hash"] == json.loads(sweep)["fingerprint_hash"]
    # the environment is the sweep's, byte for byte
    fp = (root / "fingerprint.json").read_bytes()
    assert fp == (folder / SWEEP / "fingerprint.json").read_bytes()
    t = doc["training"]
    assert t["families"] == sorted(FAMILIES) and t["keys"] == len(json.loads(sweep)["keys"])
    # the gate the chosen class's leave-one-family-out answers chose (feature set 2)
    assert doc["schema_version"] == "1.2" and t["feature_version"] == 2
    steps = t["gate_steps"][t["chosen"]]
    safe = next(j for j, st in enumerate(steps) if st["slower"] == 0)
    want = steps[min(safe + GATE_GUARD, len(steps) - 1)]["min_speedup"]
    assert t["gate"] == doc["gate"] == {"min_confidence": 0.6, "min_speedup": want}
    assert t["classes"][t["chosen"]]["dispatch"] == next(
        st["dispatch"] for st in steps if st["min_speedup"] == want
    )
    assert set(t["classes"]) == {"forest", "extra_trees"} and t["chosen"] in t["classes"]
    assert set(t["lofo_calibrations"]) == set(FAMILIES) and len(t["outcomes"]) == t["keys"]
    model = PerfModel.from_doc(doc)
    assert model.families == frozenset(doc["shape_families"])
    model.choice(preset_shape("olmoe-1b-7b", 16), "uniform")  # answers a key it never measured
    report = (root / REPORT_FILE).read_text()
    assert report.startswith("# Learned performance model")
    assert f"| {t['chosen']} (chosen) |" in report


def test_excluded_families_are_left_out_and_recorded(folder: Path, tmp_path: Path) -> None:
    shutil.copytree(folder / SWEEP, tmp_path / SWEEP)
    root = write_model_bundle([tmp_path / SWEEP], tmp_path / "m", exclude=["qwen3-30b-a3b"])
    doc = json.loads((root / MODEL_FILE).read_text())
    assert doc["excluded"] == ["qwen3-30b-a3b"]
    assert "qwen3-30b-a3b" not in doc["training"]["families"]
    assert preset_shape("qwen3-30b-a3b", 1).family not in doc["shape_families"]
    assert audit_codes(root) == set()
    # edited to claim no family was left out: the recomputed training differs
    edit_claim(root, MODEL_FILE, lambda d: d.__setitem__("excluded", []))
    assert {"perfmodel.family_mismatch", "perfmodel.training_mismatch"} <= audit_codes(root)


def test_training_refuses_what_cannot_be_audited(folder: Path, tmp_path: Path) -> None:
    shutil.copytree(folder / SWEEP, tmp_path / SWEEP)
    with pytest.raises(UsageError, match="no sweep holds"):
        write_model_bundle([tmp_path / SWEEP], tmp_path / "m", exclude=["mixtral-8x22b"])
    with pytest.raises(UsageError, match="model bundle's folder"):
        write_model_bundle([tmp_path / SWEEP], tmp_path / "elsewhere" / "m")
    other = dict(FP, driver="999.0")
    synthetic_sweep_bundle(tmp_path, "other-sweep", raw_sweep(fingerprint=other))
    with pytest.raises(UsageError, match="2 environments"):
        write_model_bundle([tmp_path / SWEEP, tmp_path / "other-sweep"], tmp_path / "m")
    with pytest.raises(UsageError, match="named twice"):
        write_model_bundle([tmp_path / SWEEP, tmp_path / SWEEP], tmp_path / "m")
    assert not (tmp_path / "m").exists()


def _tree_value(d: dict[str, Any]) -> None:
    t = d["model"]["trees"][3]
    t["value"][0] = t["value"][0] + 0.01


@pytest.mark.parametrize(
    ("edit", "code"),
    [
        (_tree_value, "perfmodel.model_mismatch"),
        (lambda d: d["model"]["trees"][0]["threshold"].__setitem__(0, 0.123), "perfmodel.model_mismatch"),
        (lambda d: d["model"]["trees"][0]["left"].__setitem__(0, 0), "perfmodel.model_invalid"),
        (lambda d: d["gate"].__setitem__("min_confidence", 0.5), "perfmodel.gate_mismatch"),
        (lambda d: d["training"]["gate"].__setitem__("min_speedup", 1.0), "perfmodel.gate_mismatch"),
        (lambda d: d["calibration"].__setitem__("a", 1.0), "perfmodel.calibration_mismatch"),
        (lambda d: d["training"]["classes"]["forest"].__setitem__("dispatch", 2.0),
         "perfmodel.score_mismatch"),
        (lambda d: d["training"]["outcomes"][0].__setitem__("measured", 2.0),
         "perfmodel.outcome_mismatch"),
        (lambda d: d["training"].__setitem__("rows", 1), "perfmodel.training_mismatch"),
        (lambda d: d["feature_names"].__setitem__(0, "log2_e"), "perfmodel.feature_mismatch"),
        (lambda d: d["shape_families"].pop(), "perfmodel.family_mismatch"),
        (lambda d: d["sweeps"][0].__setitem__("sha256", "0" * 64), "perfmodel.sweep_mismatch"),
        (lambda d: d["sweeps"][0].__setitem__("bundle", "h200-perf-sweep-2"), "perfmodel.sweep_missing"),
        (lambda d: d.__setitem__("fingerprint_hash", "0" * 16), "perfmodel.fingerprint_mismatch"),
    ],
)  # fmt: skip
def test_every_kind_of_edit_is_a_finding(
    folder: Path, tmp_path: Path, edit: Any, code: str
) -> None:
    root = _copy(folder, tmp_path)
    edit_claim(root, MODEL_FILE, edit)
    assert code in audit_codes(root)
    assert code in CHECKS


def test_a_missing_or_changed_sweep_is_a_finding(folder: Path, tmp_path: Path) -> None:
    root = _copy(folder, tmp_path)
    edit_claim(tmp_path / SWEEP, "sweep.json", lambda d: d["errors"].append("edited"))
    assert audit_codes(root) == {"perfmodel.sweep_mismatch"}
    shutil.rmtree(tmp_path / SWEEP)
    (f,) = audit_paths([root]).findings
    assert (f.check, f.field) == ("perfmodel.sweep_missing", "sweeps[0].bundle")
    (tmp_path / SWEEP).symlink_to(folder / SWEEP)  # a link is never followed
    assert audit_codes(root) == {"perfmodel.sweep_missing"}


def test_an_edited_report_is_a_finding(folder: Path, tmp_path: Path) -> None:
    root = _copy(folder, tmp_path)
    md = root / REPORT_FILE
    md.write_text(md.read_text().replace("Gate: an answer", "Gate: every answer"))
    m = json.loads((root / "manifest.json").read_text())
    from mxdb.evidence.writer import write_manifest

    write_manifest(root, bundle_id=m["bundle_id"], milestone=m["milestone"])
    assert audit_codes(root) == {"perfmodel.report_mismatch"}


def test_without_scikit_learn_what_needs_no_training_is_still_checked(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mxdb.audit import perfmodel

    monkeypatch.setattr(perfmodel, "has_sklearn", lambda: False)
    root = _copy(folder, tmp_path)
    assert audit_codes(root) == set()
    doc = json.loads((root / MODEL_FILE).read_text())
    chosen = doc["training"]["chosen"]
    for edit, code in [
        (lambda d: d["training"]["outcomes"][1].__setitem__("measured", 2.0),
         "perfmodel.outcome_mismatch"),
        (lambda d: d["training"]["classes"][chosen].__setitem__("answered", 99),
         "perfmodel.score_mismatch"),
        (lambda d: d["training"].__setitem__("keys", 1), "perfmodel.training_mismatch"),
        (lambda d: d["calibration"].__setitem__("n", 1), "perfmodel.calibration_mismatch"),
        (lambda d: d["gate"].__setitem__("min_speedup", 1.0), "perfmodel.gate_mismatch"),
    ]:  # fmt: skip
        before = (root / MODEL_FILE).read_bytes()
        edit_claim(root, MODEL_FILE, edit)
        assert code in audit_codes(root)
        (root / MODEL_FILE).write_bytes(before)
        edit_claim(root, MODEL_FILE, lambda d: None)
    # the trees are checked only by training again
    edit_claim(root, MODEL_FILE, _tree_value)
    assert audit_codes(root) == set()


def _committed(tmp_path: Path, model: str = MODEL) -> Path:
    """The committed model copied with its sweep (and the check it was calibrated on)."""
    check = json.loads((EVIDENCE / model / MODEL_FILE).read_text()).get("calibrated_on")
    for name in (SWEEP, model, *([check["bundle"]] if check else [])):
        shutil.copytree(EVIDENCE / name, tmp_path / name)
    return tmp_path / model


def test_a_last_bit_difference_of_a_number_is_no_finding(folder: Path, tmp_path: Path) -> None:
    # the calibration's solver runs on the machine's BLAS: last bits differ between processors
    root = _copy(folder, tmp_path)
    cal = json.loads((root / MODEL_FILE).read_text())["calibration"]
    k = "a" if cal["a"] else "b"
    edit_claim(root, MODEL_FILE, lambda d: d["calibration"].__setitem__(k, cal[k] * (1 + 1e-13)))
    assert audit_codes(root) == set()
    edit_claim(root, MODEL_FILE, lambda d: d["calibration"].__setitem__(k, cal[k] * (1 + 1e-6)))
    assert audit_codes(root) == {"perfmodel.calibration_mismatch"}


@pytest.mark.parametrize(
    ("model", "version", "features"),
    [(MODEL, "1.0", 37), ("h200-perf-model-2", "1.1", 41), ("h200-perf-model-3", "1.2", 41)],
)
def test_the_committed_model_audits_clean_and_its_edits_are_findings(
    tmp_path: Path, model: str, version: str, features: int
) -> None:
    root = _committed(tmp_path, model)
    assert audit_codes(root) == set()  # trains again (kept for the later audits)
    doc = json.loads((root / MODEL_FILE).read_text())
    t = doc["training"]
    assert (t["keys"], len(t["families"])) == (252, 12) and doc["excluded"] == []
    assert doc["schema_version"] == version and len(doc["feature_names"]) == features
    assert doc["model"]["n_features"] == features
    PerfModel.from_doc(doc)
    original = (root / MODEL_FILE).read_bytes()
    for edit, code in [
        (_tree_value, "perfmodel.model_mismatch"),
        (lambda d: d["gate"].__setitem__("min_confidence", 0.55), "perfmodel.gate_mismatch"),
        (lambda d: d["sweeps"][0].__setitem__("sha256", "0" * 64), "perfmodel.sweep_mismatch"),
    ]:
        edit_claim(root, MODEL_FILE, edit)
        assert code in audit_codes(root)
        (root / MODEL_FILE).write_bytes(original)
        edit_claim(root, MODEL_FILE, lambda d: None)
    shutil.rmtree(tmp_path / SWEEP)
    assert audit_codes(root) == {"perfmodel.sweep_missing"}
