"""The model's held-out check (``check.json``): publish from raw output, audit, tampering findings.

The bundles here are synthetic: a small plan and raw points drawn so that some candidates are
faster than FlagGems' own choice, some the same, one slower (and one fails), published with
``benchmarks/perf_check.py publish`` beside sibling model and sweep bundles.  The siblings of
:func:`synthetic_check_bundle` are documents reduced to their identity (no training data), so
the audit only hashes them; :func:`test_the_plan_is_recomputed_from_real_siblings` trains a
small model on a synthetic sweep, so that the audit recomputes the plan with ``lofo_plan``.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from benchmark_scripts import load
from bundle_edits import audit_codes, edit_claim

from mxdb.audit import CHECKS, audit_paths
from mxdb.configs import KernelConfig
from mxdb.costmodel.calibration import calibration_error
from mxdb.costmodel.menu import menu
from mxdb.evidence.perfcheck import (
    CHECK_FILE,
    REPORT_FILE,
    SETTINGS,
    TARGETS,
    build_check,
    confidence_bins,
)
from mxdb.evidence.writer import write_manifest
from mxdb.fingerprint import H200
from mxdb.models import ROUTING_CLASSES
from mxdb.resources import flaggems_default_config
from mxdb.routing import expert_counts, trace_hash
from mxdb.routing_gen import generate
from mxdb.shapes import preset_shape
from mxdb.tune.traces import classify

FP = {k: v for k, v in H200.items() if k != "mxdb"}
GATE = {"min_confidence": 0.6, "min_speedup": 1.03}
FAMILIES = ("mixtral-8x7b", "olmoe-1b-7b", "qwen3-30b-a3b")
TOKENS = (4, 64)
#: the held-out sources of benchmarks/perf_check.py (logits generator parameters)
SOURCES: dict[str, dict[str, Any]] = {
    "uniform": {},
    "zipf": {"s": 1.2},
    "hot": {"hot_bias": 1.5, "hot_expert": 0},
}
CHECK = "h200-perf-check"
MODEL = "h200-perf-model"
SWEEP = "h200-perf-sweep"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _baseline(shape: Any) -> KernelConfig:
    return KernelConfig.uniform(flaggems_default_config(shape))


# -- synthetic inputs ------------------------------------------------------------------------


def synthetic_plan() -> list[dict[str, Any]]:
    """A plan as ``lofo_plan`` writes it: per family, token count and class, an answered
    config, one the gate does not answer, or FlagGems' own choice."""
    out = []
    for f, fam in enumerate(FAMILIES):
        for m in TOKENS:
            shape = preset_shape(fam, m)
            base = _baseline(shape).hash
            cands = [c for c in menu(shape) if c.hash != base]
            for c, cls in enumerate(ROUTING_CLASSES):
                if cls == "sparse":  # nothing predicted faster: FlagGems' own choice
                    out.append({"family": fam, "tokens": m, "routing_class": cls, "config": None,
                                "predicted": 0.98, "agreement": 0.0, "confidence": None,
                                "answered": False})  # fmt: skip
                    continue
                conf = (0.55, 0.7, 0.85)[(f + c) % 3]
                predicted = (1.01, 1.05, 1.08)[(f + c + m) % 3]
                out.append({
                    "family": fam, "tokens": m, "routing_class": cls,
                    "config": cands[(3 * f + c + m) % len(cands)].model_dump(),
                    "predicted": predicted, "agreement": conf + 0.1, "confidence": conf,
                    "answered": conf >= GATE["min_confidence"] and predicted >= GATE["min_speedup"],
                })  # fmt: skip
    return out


def _samples(rng: random.Random, center: float) -> list[float]:
    return [center * (1 + rng.uniform(-0.002, 0.002)) for _ in range(SETTINGS["rounds"])]


def synthetic_points(
    plan: Sequence[Mapping[str, Any]],
    families: Sequence[str] = FAMILIES,
    tokens: Sequence[int] = TOKENS,
    instances: int = SETTINGS["instances"],
) -> list[dict[str, Any]]:
    """Raw points as ``benchmarks/perf_check.py run`` writes them: the first answered candidate
    is slower than FlagGems' choice, the second fails (a wrong result), the others faster or
    the same by instance."""
    perf_check = load("perf_check.py")
    table = {(e["family"], e["tokens"], e["routing_class"]): e for e in plan}
    rng = random.Random(11)
    points: list[dict[str, Any]] = []
    answered = 0
    for fam in families:
        for m in tokens:
            shape = preset_shape(fam, m)
            base = _baseline(shape)
            for source, params in SOURCES.items():
                for i in range(instances):
                    seed = perf_check.instance_seed(fam, m, source, i)
                    ids = generate("logits", m, shape.experts, shape.topk, seed, **params)
                    cls = classify(ids, shape.experts)
                    entry = table[(fam, m, cls)]
                    t = 40.0 + 0.5 * m
                    arms = [{"config": base.model_dump(), "role": r, "status": "ok",
                             "samples": _samples(rng, t), "error": None}
                            for r in ("baseline", "control", "control")]  # fmt: skip
                    if entry["config"] is not None:
                        arm = {"config": entry["config"], "role": "candidate", "status": "ok",
                               "samples": [], "error": None}  # fmt: skip
                        if entry["answered"]:
                            answered += 1
                        if entry["answered"] and answered == 1:
                            arm["samples"] = _samples(rng, t * 1.1)  # slower
                        elif entry["answered"] and answered == 2:
                            arm["status"], arm["error"] = "wrong", "max abs err 0.5 (limit 0.0625)"
                        else:
                            arm["samples"] = _samples(rng, t * (0.88, 0.93, 1.0)[i % 3])
                        arms.append(arm)
                    points.append({
                        "family": fam, "shape": shape.to_dict(), "tokens": m, "source": source,
                        "instance": i, "routing": {"kind": "logits", "params": params, "seed": seed},
                        "trace_hash": trace_hash(ids, shape.experts),
                        "counts": [int(x) for x in expert_counts(ids, shape.experts)],
                        "routing_class": cls, "baseline": base.model_dump(),
                        "calls_per_sample": 8, "arms": arms,
                    })  # fmt: skip
    return points


def _write_doc(folder: Path, name: str, doc: Mapping[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(doc, indent=1))
    return folder


def identity_siblings(parent: Path) -> tuple[Path, Path]:
    """Sibling model and sweep bundles reduced to their identity (no training data)."""
    sweep = _write_doc(parent / SWEEP, "sweep.json",
                       {"schema": "mxdb.perf-sweep", "schema_version": "1.0"})  # fmt: skip
    model = _write_doc(parent / MODEL, "model.json", {
        "schema": "mxdb.perf-model", "schema_version": "1.0", "gate": GATE,
        "sweeps": [{"bundle": SWEEP, "sha256": _sha(sweep / "sweep.json")}],
    })  # fmt: skip
    return model, sweep


def publish(
    parent: Path,
    plan: Sequence[Mapping[str, Any]],
    points: Sequence[Mapping[str, Any]],
    model: Path,
    sweep: Path,
    name: str = CHECK,
) -> Path:
    """The bundle ``benchmarks/perf_check.py publish`` writes beside ``model`` and ``sweep``."""
    work = parent / f"{name}-inputs"
    work.mkdir()
    (work / "plan.json").write_text(json.dumps({"entries": list(plan), "shapes": {}}))
    raw = {"fingerprint": FP, "points": list(points), "errors": ["one family not timed (test)"]}
    (work / "raw.json").write_text(json.dumps(raw))
    return Path(load("perf_check.py").publish(work / "plan.json", work / "raw.json", model,
                                              sweep, parent / name))  # fmt: skip


def synthetic_check_bundle(parent: Path) -> Path:
    """A published check bundle in ``parent``, beside identity-only model and sweep bundles."""
    model, sweep = identity_siblings(parent)
    plan = synthetic_plan()
    return publish(parent, plan, synthetic_points(plan), model, sweep)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic_check_bundle(tmp_path_factory.mktemp("check"))


def _copy(bundle: Path, tmp_path: Path) -> Path:
    """A copy of the check bundle and its siblings (the check names them by folder)."""
    for d in (CHECK, MODEL, SWEEP):
        shutil.copytree(bundle.parent / d, tmp_path / d)
    return tmp_path / CHECK


def _doc(bundle: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((bundle / CHECK_FILE).read_text())
    return doc


# -- the published bundle --------------------------------------------------------------------


def test_published_bundle_audits_clean_with_figures_from_the_samples(bundle: Path) -> None:
    assert list(audit_paths([bundle]).findings) == []
    doc = _doc(bundle)
    f = doc["figures"]
    pts = doc["points"]
    assert f["points"] == len(pts) == len(FAMILIES) * len(TOKENS) * 3 * 3
    outcomes = {p["outcome"] for p in pts}
    assert {"faster", "same", "slower", "failed", None} <= outcomes
    assert (f["answered_slower"], f["answered_failed"]) == (1, 1)
    assert f["answered"] == sum(p["answered"] for p in pts) > 2
    for p in pts:
        assert p["plan_entry"]["routing_class"] == p["routing_class"]
        assert p["answered"] is p["plan_entry"]["answered"]
        assert p["arms"][0]["median_us"] == pytest.approx(40.0 + 0.5 * p["tokens"], rel=0.01)
        if not p["answered"]:
            assert p["dispatch_speedup"] == 1.0  # FlagGems' own choice runs
        elif p["outcome"] == "failed":
            assert p["dispatch_speedup"] is None and p["candidate_speedup"] is None
        else:
            assert p["dispatch_speedup"] == p["candidate_speedup"]
    fast = [p for p in pts if p["outcome"] == "faster"]
    assert all(p["candidate_speedup"] > 1.05 for p in fast)
    # a missed target is a recorded fact, not a finding
    by_name = {t["name"]: t for t in doc["targets"]}
    assert set(by_name) == {t.name for t in TARGETS}
    assert by_name["answered_never_slower"]["measured"] == 1.0
    assert by_name["answered_never_slower"]["passed"] is False
    assert doc["model"]["sha256"] == _sha(bundle.parent / MODEL / "model.json")
    assert doc["sweep"] == {"bundle": SWEEP, "sha256": _sha(bundle.parent / SWEEP / "sweep.json")}
    assert doc["gate"] == GATE and doc["settings"] == SETTINGS
    report = (bundle / REPORT_FILE).read_text()
    assert report.startswith("# The performance model on families it never saw")
    assert "| failed |" in report and "| slower |" in report


def test_the_calibration_bins_add_up_to_the_calibration_error(bundle: Path) -> None:
    doc = _doc(bundle)
    pairs = [(p["confidence"], p["outcome"] == "faster") for p in doc["points"]
             if p["candidate_speedup"] is not None]  # fmt: skip
    f = doc["figures"]
    assert f["candidates_timed"] == len(pairs) and f["calibration_error"] is not None
    assert f["calibration_error"] == pytest.approx(calibration_error(pairs))
    bins = confidence_bins(pairs)
    assert f["confidence_bins"] == bins and sum(b["count"] for b in bins) == len(pairs)
    err = sum(b["count"] * abs(b["mean_confidence"] - b["win_rate"]) for b in bins if b["count"])
    assert err / len(pairs) == pytest.approx(f["calibration_error"])


def test_a_point_without_a_plan_entry_is_refused(tmp_path: Path) -> None:
    plan = synthetic_plan()
    points = synthetic_points(plan, families=FAMILIES[:1], tokens=TOKENS[:1], instances=1)
    model, sweep = identity_siblings(tmp_path)
    with pytest.raises(ValueError, match="no entry"):
        build_check(points, plan=plan[4:], model={"gate": GATE}, model_bundle=model,
                    sweep_bundle=sweep, milestone="m", fingerprint_hash="0" * 16)  # fmt: skip


def _used(doc: Mapping[str, Any], answered: bool = True) -> tuple[int, int]:
    """(point index, plan index) of the first point with a timed candidate (answered or not)."""
    plan = [(e["family"], e["tokens"], e["routing_class"]) for e in doc["plan"]]
    i, p = next((i, p) for i, p in enumerate(doc["points"])
                if p["answered"] is answered and p["candidate_speedup"] is not None)  # fmt: skip
    return i, plan.index((p["family"], p["tokens"], p["routing_class"]))


def _set_plan(d: dict[str, Any], key: str, value: Any) -> None:
    d["plan"][_used(d)[1]][key] = value


def _other_config(d: dict[str, Any]) -> None:
    i, j = _used(d)
    shape = preset_shape(d["points"][i]["family"], d["points"][i]["tokens"])
    other = next(c for c in menu(shape) if c.model_dump() != d["plan"][j]["config"])
    d["plan"][j]["config"] = other.model_dump()


def _dup(d: dict[str, Any]) -> None:
    d["points"].append(d["points"][0])


def _move_count(d: dict[str, Any]) -> None:
    c = d["points"][0]["counts"]
    j = next(j for j, x in enumerate(c) if x > 0)
    c[j] -= 1
    c[(j + 1) % len(c)] += 1


def _point(key: str, value: Any, i: int = 0) -> Any:
    return lambda d: d["points"][i].__setitem__(key, value)


def _first_answered(d: dict[str, Any], key: str, value: Any) -> None:
    d["points"][_used(d)[0]][key] = value


def _target(name: str, key: str, value: Any) -> Any:
    def edit(d: dict[str, Any]) -> None:
        next(t for t in d["targets"] if t["name"] == name)[key] = value

    return edit


def _scale_sample(d: dict[str, Any]) -> None:
    arm = d["points"][_used(d)[0]]["arms"][3]
    arm["samples"] = [x * 0.5 for x in arm["samples"]]


EDITS: list[tuple[str, Any, str]] = [
    ("sample", lambda d: d["points"][0]["arms"][0]["samples"].__setitem__(0, 99.0),
     "perfcheck.median_mismatch"),
    ("candidate samples", _scale_sample, "perfcheck.speedup_mismatch"),
    ("invalid sample", lambda d: d["points"][0]["arms"][1]["samples"].__setitem__(0, -1.0),
     "perfcheck.sample_invalid"),
    ("missing round", lambda d: d["points"][0]["arms"][1]["samples"].pop(),
     "perfcheck.sample_invalid"),
    ("median", lambda d: d["points"][1]["arms"][2].__setitem__("median_us", 1.0),
     "perfcheck.median_mismatch"),
    ("speedup", lambda d: _first_answered(d, "candidate_speedup", 2.0),
     "perfcheck.speedup_mismatch"),
    ("dispatch speedup", lambda d: _first_answered(d, "dispatch_speedup", 2.0),
     "perfcheck.speedup_mismatch"),
    ("outcome", lambda d: _first_answered(d, "outcome", "faster"), "perfcheck.verdict_mismatch"),
    ("figure", lambda d: d["figures"].__setitem__("geomean_dispatch_speedup", 1.2),
     "perfcheck.geomean_mismatch"),
    ("count", lambda d: d["figures"].__setitem__("answered_slower", 0), "perfcheck.count_mismatch"),
    ("family figure", lambda d: d["figures"]["by_family"]["olmoe-1b-7b"].__setitem__(
        "answered", 0), "perfcheck.count_mismatch"),
    ("calibration", lambda d: d["figures"].__setitem__("calibration_error", 0.01),
     "perfcheck.calibration_mismatch"),
    ("bin", lambda d: d["figures"]["confidence_bins"][7].__setitem__("count", 99),
     "perfcheck.calibration_mismatch"),
    ("target state", _target("answered_never_slower", "passed", True),
     "perfcheck.target_verdict_mismatch"),
    ("target measured", _target("answered_never_slower", "measured", 0.0),
     "perfcheck.target_measured_mismatch"),
    ("target threshold", _target("dispatch_geomean", "threshold", 1.0),
     "perfcheck.target_threshold_mismatch"),
    ("target statement", _target("dispatch_geomean", "statement", "fast"),
     "perfcheck.target_threshold_mismatch"),
    ("target dropped", lambda d: d["targets"].pop(), "perfcheck.target_missing"),
    ("plan config", _other_config, "perfcheck.config_mismatch"),
    ("plan confidence", lambda d: _set_plan(d, "confidence", 0.99), "perfcheck.plan_mismatch"),
    ("plan answered", lambda d: _set_plan(d, "answered", False), "perfcheck.plan_mismatch"),
    ("plan duplicate", lambda d: d["plan"].append(d["plan"][0]), "perfcheck.plan_mismatch"),
    ("plan missing", lambda d: d["plan"].pop(_used(d)[1]), "perfcheck.plan_mismatch"),
    ("confidence", lambda d: _first_answered(d, "confidence", 0.99), "perfcheck.plan_mismatch"),
    ("answered", lambda d: _first_answered(d, "answered", False), "perfcheck.plan_mismatch"),
    ("trace hash", _point("trace_hash", "0" * 16), "perfcheck.trace_mismatch"),
    ("seed", lambda d: d["points"][0]["routing"].__setitem__("seed", 7),
     "perfcheck.trace_mismatch"),
    ("generator", lambda d: d["points"][0]["routing"].__setitem__("kind", "uniform"),
     "perfcheck.trace_mismatch"),
    ("counts", _move_count, "perfcheck.trace_mismatch"),
    ("counts total", lambda d: d["points"][0]["counts"].__setitem__(0, 10_000),
     "perfcheck.routing_mismatch"),
    ("class", _point("routing_class", "sparse"), "perfcheck.routing_mismatch"),
    ("shape", lambda d: d["points"][0]["shape"].__setitem__("hidden", 1024),
     "perfcheck.shape_mismatch"),
    ("copy config", lambda d: d["points"][0]["arms"][1].__setitem__(
        "config", d["plan"][_used(d)[1]]["config"]), "perfcheck.config_mismatch"),
    ("candidate dropped", lambda d: d["points"][_used(d)[0]]["arms"].pop(),
     "perfcheck.config_mismatch"),
    ("arms", lambda d: d["points"][0]["arms"].pop(1), "perfcheck.arms_invalid"),
    ("instance", _point("instance", 5), "perfcheck.field_mismatch"),
    ("duplicate point", _dup, "perfcheck.point_duplicate"),
    ("settings", lambda d: d["settings"].__setitem__("rounds", 7), "perfcheck.field_mismatch"),
    ("model hash", lambda d: d["model"].__setitem__("sha256", "0" * 64),
     "perfcheck.bundle_mismatch"),
    ("sweep name", lambda d: d["sweep"].__setitem__("bundle", "h200-other-sweep"),
     "perfcheck.bundle_missing"),
    ("gate", lambda d: d["gate"].__setitem__("min_confidence", 0.5), "perfcheck.bundle_mismatch"),
    ("fingerprint", lambda d: d.__setitem__("fingerprint_hash", "0" * 16),
     "perfcheck.fingerprint_mismatch"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "edit", "code"), EDITS, ids=[e[0] for e in EDITS])
def test_every_kind_of_edit_is_a_finding(
    bundle: Path, tmp_path: Path, what: str, edit: Any, code: str
) -> None:
    root = _copy(bundle, tmp_path)
    edit_claim(root, CHECK_FILE, edit)
    assert code in audit_codes(root), what
    assert code in CHECKS


def test_the_sibling_bundles_must_be_beside_it_and_unchanged(bundle: Path, tmp_path: Path) -> None:
    root = _copy(bundle, tmp_path)
    shutil.rmtree(tmp_path / MODEL)
    assert "perfcheck.bundle_missing" in audit_codes(root)
    root = _copy(bundle, tmp_path / "b")
    sweep = tmp_path / "b" / SWEEP / "sweep.json"
    sweep.write_text(sweep.read_text().replace("1.0", "1.1"))
    assert "perfcheck.bundle_mismatch" in audit_codes(root)
    root = _copy(bundle, tmp_path / "c")
    model = tmp_path / "c" / MODEL / "model.json"
    model.write_text(json.dumps({**json.loads(model.read_text()), "schema": "mxdb.peers"}))
    edit_claim(root, CHECK_FILE, lambda d: d["model"].__setitem__("sha256", _sha(model)))
    assert "perfcheck.bundle_mismatch" in audit_codes(root)


def test_an_edited_report_is_a_finding(bundle: Path, tmp_path: Path) -> None:
    root = _copy(bundle, tmp_path)
    md = root / REPORT_FILE
    md.write_text(md.read_text().replace("| mixtral-8x7b |", "| mixtral-8x22b |", 1))
    write_manifest(root, bundle_id=CHECK, milestone=CHECK)
    (f,) = [f for f in audit_paths([root]).findings if f.check == "perfcheck.report_mismatch"]
    assert f.file.endswith(REPORT_FILE) and f.field.startswith("line ")


# -- real siblings: the plan recomputed ------------------------------------------------------


def _factor(fam: str, m: int, cfg: KernelConfig) -> float:
    """A synthetic speedup landscape: small tiles pay at small M, ``fused_slice`` at M = 1."""
    d = hashlib.sha256(f"{fam}|{m}|{cfg.hash}".encode()).digest()
    f = 0.95 + 0.1 * d[0] / 255
    if cfg.impl == "fused_slice":
        f *= 0.8 if m == 1 else 1.1
    if cfg.gemm1.block_m == 16:
        f *= 0.9 if m == 1 else 1.05
    return f


def _sweep_keys(families: Sequence[str], tokens: Sequence[int]) -> list[dict[str, Any]]:
    keys = []
    rng = random.Random(3)
    for fam in families:
        for m in tokens:
            shape = preset_shape(fam, m)
            base = _baseline(shape)
            t = 50.0 + 0.1 * m

            def s(f: float, t: float = t) -> list[float]:
                return [t * f * (1 + rng.uniform(-0.003, 0.003)) for _ in range(7)]

            arms = [{"role": r, "status": "ok", "config": base.model_dump(), "samples": s(1.0)}
                    for r in ("baseline", "control", "control")]  # fmt: skip
            arms += [{"role": "candidate", "status": "ok", "config": c.model_dump(),
                      "samples": s(_factor(fam, m, c))}
                     for c in menu(shape) if c.hash != base.hash]  # fmt: skip
            keys.append({"family": fam, "tokens": m, "source": "uniform",
                         "routing_class": "uniform", "shape": shape.to_dict(),
                         "baseline": base.model_dump(), "arms": arms})  # fmt: skip
    return keys


def test_the_plan_is_recomputed_from_real_siblings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("sklearn")
    from mxdb.audit import perfcheck
    from mxdb.costmodel.train import lofo_plan, train

    tokens = (1, 16)
    keys = _sweep_keys(FAMILIES, tokens)
    trained = train(keys)
    training = {k: trained[k] for k in ("classes", "chosen", "lofo_calibrations", "outcomes",
                                        "gate", "rows", "keys", "families")}  # fmt: skip
    sweep = _write_doc(tmp_path / SWEEP, "sweep.json",
                       {"schema": "mxdb.perf-sweep", "schema_version": "1.0", "keys": keys})  # fmt: skip
    model = _write_doc(tmp_path / MODEL, "model.json", {
        "schema": "mxdb.perf-model", "schema_version": "1.0", "gate": trained["gate"],
        "sweeps": [{"bundle": SWEEP, "sha256": _sha(sweep / "sweep.json")}],
        "model": trained["model"], "calibration": trained["calibration"], "training": training,
    })  # fmt: skip
    plan = lofo_plan(keys, training, tokens)
    points = synthetic_points(plan, tokens=tokens, instances=1)
    root = publish(tmp_path, plan, points, model, sweep)
    perfcheck._PLANS.clear()
    assert audit_codes(root) == set()
    assert len(perfcheck._PLANS) == 1  # recomputed (and kept for the next audit)

    used = {(p["family"], p["tokens"], p["routing_class"]) for p in points}
    j = next(j for j, e in enumerate(plan)
             if (e["family"], e["tokens"], e["routing_class"]) not in used)  # fmt: skip
    # an entry no point used: only the recomputation can tell
    edit_claim(root, CHECK_FILE, lambda d: d["plan"][j].__setitem__(
        "predicted", d["plan"][j]["predicted"] * 1.001))  # fmt: skip
    found = [f for f in audit_paths([root]).findings if f.check == "perfcheck.plan_mismatch"]
    assert [f.field for f in found] == [f"plan[{j}].predicted"]
    # without scikit-learn the plan cannot be recomputed: the other checks still run
    monkeypatch.setattr(perfcheck, "_sklearn", lambda: False)
    assert audit_codes(root) == set()
