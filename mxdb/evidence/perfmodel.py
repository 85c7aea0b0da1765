"""The learned performance model as evidence (``model.json``, ``mxdb.perf-model`` 1.2).

:func:`write_model_bundle` (``mxdb model train``) trains the model
(:func:`mxdb.costmodel.train.train`) on the keys of one or more performance sweeps of one host
(``mxdb.perf-sweep`` bundles, :mod:`mxdb.evidence.sweep`), less the keys of the families it is
told to leave out, and writes a bundle beside the sweeps::

    fingerprint.json   the sweeps' environment (copied from the first sweep bundle)
    model.json         mxdb.perf-model: the model and how it was chosen
    report/model.md    the comparison of the model classes, the gate and the chosen class
    manifest.json

``model.json`` holds:

- ``sweeps``: each sweep bundle by its folder name (beside this bundle) and the SHA-256 of its
  ``sweep.json``; ``excluded``: the families (``mxdb.shapes`` preset names) left out;
- ``shape_families``: the shape families trained on (``MoEShape.family``, sorted), the keys a
  dispatcher may call measured; ``feature_names``: the model's inputs
  (:data:`mxdb.costmodel.features.FEATURE_NAMES`);
- ``model`` (the chosen class's forest trained on every family, as plain data),
  ``calibration`` (its confidence map) and ``gate`` (when an answer is given): what
  :class:`mxdb.costmodel.model.PerfModel` loads;
- ``training``: the rest of what training returns: every class's leave-one-family-out score,
  the chosen class, the per-family calibrations, the leave-one-family-out outcomes at every key,
  the gate, and the counts of rows, keys and families (``benchmarks/perf_check.py plan`` reads
  it);
- ``trained_with``: the versions of scikit-learn and numpy that trained it.

Schema 1.1 trains on feature set 2 (:data:`mxdb.costmodel.features.FEATURE_SETS`) and chooses
each class's gate from its leave-one-family-out answers (:func:`mxdb.costmodel.train.select_gate`);
its ``training`` adds ``feature_version`` and ``gate_steps`` (each class's score at every step
the gate was chosen from).  Documents of 1.0 (feature set 1, the fixed default gate) are read
and audited as they were trained.

Schema 1.2 adds calibration on a held-out check (``mxdb model train --calibrate-on``): a
``mxdb.perf-check`` bundle beside this one that timed the leave-one-family-out choices of a
model trained on the same sweeps (``calibrated_on``: its folder name and the SHA-256 of its
``check.json``).  ``calibration`` is then fitted on the check's outcomes
(:func:`mxdb.costmodel.calibration.fit_gated`: it adds the coefficients ``c`` and ``d`` and the
``step``), and ``training.check_calibrations`` holds, per family, the map fitted on the other
families' outcomes (what a check of this model states).  Without ``calibrated_on`` a 1.2
document is calibrated on the sweep, as 1.1.

Training is deterministic (fixed seeds, one thread), so ``mxdb audit`` trains again from the
same sweeps and compares (:mod:`mxdb.audit.perfmodel`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from mxdb.costmodel.features import FEATURE_SETS
from mxdb.costmodel.train import CheckPoint
from mxdb.errors import UsageError
from mxdb.evidence.cells import cell
from mxdb.evidence.files import sha256_hex
from mxdb.evidence.models import _HEX16, _HEX64, _ID, KNOWN_VERSIONS, _Doc, optional_fields
from mxdb.evidence.sweep import SCHEMA as SWEEP_SCHEMA
from mxdb.evidence.sweep import SWEEP_FILE

MODEL_FILE = "model.json"
REPORT_FILE = "report/model.md"
SCHEMA = "mxdb.perf-model"
SCHEMA_VERSION = "1.2"
#: schema version -> the feature set (and gate rule) its models are trained with
FEATURE_VERSION: dict[str, int] = {"1.0": 1, "1.1": 2, "1.2": 2}
#: the document of a held-out check bundle (:mod:`mxdb.evidence.perfcheck`)
CHECK_SCHEMA = "mxdb.perf-check"
CHECK_FILE = "check.json"

# the versions of this document the audit understands
KNOWN_VERSIONS.setdefault(SCHEMA, tuple(FEATURE_VERSION))


def feature_version(doc: Mapping[str, Any]) -> int:
    """The feature set a model document of any known schema version was trained with."""
    return FEATURE_VERSION.get(str(doc.get("schema_version")), FEATURE_VERSION[SCHEMA_VERSION])


class SweepRef(_Doc):
    """A sweep bundle the model was trained on."""

    bundle: str = Field(pattern=_ID, description="the sweep bundle's folder, beside this bundle")
    sha256: str = Field(pattern=_HEX64, description="SHA-256 of its sweep.json")


class CheckRef(_Doc):
    """The held-out check bundle the confidence was calibrated on."""

    bundle: str = Field(pattern=_ID, description="the check bundle's folder, beside this bundle")
    sha256: str = Field(pattern=_HEX64, description="SHA-256 of its check.json")


class TreeDoc(_Doc):
    """One regression tree (:mod:`mxdb.costmodel.trees`): node ``j`` is a leaf when
    ``left[j] == -1``, else ``x[feature[j]] <= threshold[j]`` goes left."""

    left: list[int]
    right: list[int]
    feature: list[int]
    threshold: list[float]
    value: list[float]


class ForestDoc(_Doc):
    """A forest: the mean of its trees' predictions (log speedup over FlagGems' choice)."""

    kind: Literal["forest"]
    n_features: int = Field(ge=1)
    trees: list[TreeDoc] = Field(min_length=1)


class CalibrationDoc(_Doc):
    """Platt scaling (:mod:`mxdb.costmodel.calibration`): of the trees' agreement (``a``,
    ``b``), and on a check (1.2) of the log predicted speedup (``c``) and whether it reaches
    ``step`` (``d``)."""

    model_config = optional_fields("c", "d", "step")  # a sweep's map has none of them

    a: float
    b: float
    n: int = Field(ge=0, description="the outcomes it was fitted on")
    c: float | None = Field(default=None, description="coefficient of log predicted speedup")
    d: float | None = Field(default=None, description="coefficient of reaching the step")
    step: float | None = Field(default=None, description="the gate's predicted speedup")


class GateDoc(_Doc):
    """When a prediction is answered (:class:`mxdb.costmodel.train.Gate`)."""

    min_confidence: float
    min_speedup: float


class ClassScore(_Doc):
    """A model class's leave-one-family-out figures (:func:`mxdb.costmodel.train.score`)."""

    dispatch: float = Field(description="geomean speedup of the gated answers (fallback 1.0)")
    answered: int
    slower: int
    calibration_error: float
    chosen: float = Field(description="geomean speedup of the ungated choices")
    best: float = Field(description="geomean speedup of the best measured config")
    points: int


class OutcomeDoc(_Doc):
    """A leave-one-family-out choice at one sweep key and what it measured there."""

    key: int = Field(ge=0, description="the key's index in the sweeps' keys")
    family: str
    config_hash: str | None = Field(pattern=_HEX16)
    predicted: float
    agreement: float
    measured: float
    outcome: Literal["faster", "slower", "same", "fallback", "untimed"]
    best: float


class GateStep(_Doc):
    """One class's leave-one-family-out figures under a gate of one predicted speedup."""

    min_speedup: float
    dispatch: float
    answered: int
    slower: int


class TrainingDoc(_Doc):
    """Everything training returns besides the model, its calibration and gate."""

    model_config = optional_fields("feature_version", "gate_steps", "check_calibrations")

    classes: dict[str, ClassScore]
    chosen: str
    lofo_calibrations: dict[str, CalibrationDoc]
    outcomes: list[OutcomeDoc]
    gate: GateDoc
    rows: int
    keys: int
    families: list[str]
    feature_version: int | None = Field(default=None, description="1.1: the feature set")
    gate_steps: dict[str, list[GateStep]] | None = Field(
        default=None, description="1.1: each class's score at every gate step it chose from"
    )
    check_calibrations: dict[str, CalibrationDoc] | None = Field(
        default=None, description="1.2: per family, the map fitted on the check's other families"
    )


class PerfModelDoc(_Doc):
    """``model.json``: a learned performance model (module docstring)."""

    model_config = optional_fields("calibrated_on")  # 1.0 and 1.1 have none

    schema_name: Literal["mxdb.perf-model"] = Field(default="mxdb.perf-model", alias="schema")
    schema_version: Literal["1.0", "1.1", "1.2"] = "1.2"
    milestone: str
    fingerprint_hash: str = Field(pattern=_HEX16)
    sweeps: list[SweepRef] = Field(min_length=1)
    calibrated_on: CheckRef | None = Field(
        default=None,
        description="1.2: the check the confidence was calibrated on (None: the sweep)",
    )
    excluded: list[str] = Field(description="preset names of the families left out")
    shape_families: list[str]
    feature_names: list[str]
    model: ForestDoc
    calibration: CalibrationDoc
    gate: GateDoc
    training: TrainingDoc
    trained_with: dict[str, str] = Field(description="library versions that trained the model")

    def to_json_dict(self) -> dict[str, Any]:
        """As written to disk: an optional field a document does not hold stays absent
        (a sweep's calibration has no ``c``; 1.1 has no ``calibrated_on``)."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)


#: train()'s keys that are fields of their own (the rest is ``training``)
_OWN = ("model", "calibration", "gate")


def training_keys(
    sweeps: Sequence[Mapping[str, Any]], excluded: Sequence[str]
) -> list[Mapping[str, Any]]:
    """The keys the model trains on: every sweep's, in order, less those of ``excluded``."""
    drop = set(excluded)
    return [k for s in sweeps for k in s["keys"] if k["family"] not in drop]


def shape_families(keys: Sequence[Mapping[str, Any]]) -> list[str]:
    """The shape families (``MoEShape.family``) of the keys, sorted."""
    from mxdb.shapes import MoEShape

    return sorted({MoEShape.from_dict(dict(k["shape"])).family for k in keys})


def split_training(result: Mapping[str, Any]) -> dict[str, Any]:
    """``model``, ``calibration``, ``gate`` and ``training`` (the rest, with the gate) of
    :func:`mxdb.costmodel.train.train`'s result."""
    return {
        "model": result["model"],
        "calibration": result["calibration"],
        "gate": result["gate"],
        "training": {k: v for k, v in result.items() if k not in _OWN or k == "gate"},
    }


def trained_with() -> dict[str, str]:
    """The versions of the libraries training depends on."""
    import numpy
    import sklearn  # type: ignore[import-untyped,unused-ignore]

    return {"numpy": str(numpy.__version__), "scikit-learn": str(sklearn.__version__)}


def _load_bundle_doc(path: Path, file: str, schema: str, what: str) -> tuple[bytes, dict[str, Any]]:
    """The bytes and document of ``path/file``, a ``schema`` document (``what``: a sweep or
    a check, and the script that writes it)."""
    from mxdb.fileio import MAX_DOCUMENT_BYTES, parse_json, read_bytes

    f = path / file
    if not f.is_file():
        raise UsageError(f"{path} is not a {what} bundle: it has no {file}")
    data = read_bytes(f, limit=MAX_DOCUMENT_BYTES, what=file, error=UsageError)
    doc = parse_json(data, what=str(f), error=UsageError)
    if not isinstance(doc, dict) or doc.get("schema") != schema:
        found = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise UsageError(f"{f} is not a {what}: schema {found!r}, not {schema!r}")
    return data, doc


def _load_sweep(path: Path) -> tuple[bytes, dict[str, Any]]:
    return _load_bundle_doc(
        path, SWEEP_FILE, SWEEP_SCHEMA, "performance sweep (benchmarks/perf_sweep.py publish)"
    )


def check_points(doc: Mapping[str, Any]) -> list[CheckPoint]:
    """The timed choices of a held-out check document (every point whose candidate ran and
    was timed against FlagGems' choice: the points its calibration error is taken over)."""
    from mxdb.configs import KernelConfig
    from mxdb.costmodel.train import CheckPoint
    from mxdb.evidence.perfcheck import timed_choices
    from mxdb.shapes import MoEShape

    out = []
    for p in timed_choices(doc["points"]):
        e = p["plan_entry"]
        out.append(CheckPoint(
            family=str(p["family"]), shape=MoEShape.from_dict(dict(p["shape"])),
            routing_class=str(p["routing_class"]),
            config_hash=KernelConfig.model_validate(e["config"]).hash,
            predicted=float(e["predicted"]), agreement=float(e["agreement"]),
            faster=p["outcome"] == "faster",
        ))  # fmt: skip
    return out


def build_model(
    refs: Sequence[Mapping[str, str]],
    result: Mapping[str, Any],
    keys: Sequence[Mapping[str, Any]],
    *,
    milestone: str,
    fingerprint_hash: str,
    excluded: Sequence[str],
    libraries: Mapping[str, str],
) -> dict[str, Any]:
    """The document from the sweeps' references, the trained keys and ``train()``'s result."""
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "milestone": milestone,
        "fingerprint_hash": fingerprint_hash,
        "sweeps": [dict(r) for r in refs],
        "excluded": list(excluded),
        "shape_families": shape_families(keys),
        "feature_names": list(FEATURE_SETS[FEATURE_VERSION[SCHEMA_VERSION]]),
        **split_training(result),
        "trained_with": dict(libraries),
    }


def write_model_bundle(
    sweeps: Sequence[Path],
    out: Path,
    *,
    exclude: Sequence[str] = (),
    calibrate_on: Path | None = None,
) -> Path:
    """Train the model on the sweep bundles ``sweeps`` (less the families ``exclude`` names)
    and write its bundle to ``out``, which must lie in the same folder as the sweeps (the
    audit finds them there); returns ``out``.  ``calibrate_on``: a check bundle, in the same
    folder, of a model trained on the same sweeps (module docstring)."""
    from mxdb.costmodel.model import PerfModel
    from mxdb.costmodel.train import train
    from mxdb.evidence.writer import publish_bundle
    from mxdb.fileio import load_json
    from mxdb.models import Fingerprint

    out = Path(out)
    paths = [Path(p) for p in sweeps]
    if not paths:
        raise UsageError("training the performance model needs at least one sweep bundle")
    names = [p.resolve().name for p in paths]
    if len(set(names)) != len(names):
        raise UsageError(f"a sweep bundle is named twice: {', '.join(names)}")
    home = out.resolve().parent
    away = [str(p) for p in [*paths, *([calibrate_on] if calibrate_on else [])]
            if Path(p).resolve().parent != home]  # fmt: skip
    if away:
        raise UsageError(
            f"the sweep and check bundles must lie in the model bundle's folder {home} (the "
            f"audit finds them beside it by name); not there: {', '.join(away)}"
        )
    loaded = [_load_sweep(p) for p in paths]
    fps = sorted({str(d.get("fingerprint_hash")) for _, d in loaded})
    if len(fps) != 1:
        raise UsageError(
            f"the sweeps come from {len(fps)} environments ({', '.join(fps)}): a model is "
            "trained on the sweeps of one host; train one model per fingerprint"
        )
    fp_doc = load_json(paths[0] / "fingerprint.json", what="fingerprint", error=UsageError)
    fp = Fingerprint(**fp_doc["fingerprint"])
    if fp.hash != fps[0]:
        raise UsageError(
            f"{paths[0]}'s fingerprint.json names environment {fp.hash}, its sweep {fps[0]}"
        )
    excluded = sorted(set(exclude))
    present = {str(k["family"]) for _, d in loaded for k in d["keys"]}
    unknown = [f for f in excluded if f not in present]
    if unknown:
        raise UsageError(
            f"cannot exclude {', '.join(unknown)}: no sweep holds that family; the sweeps hold "
            f"{', '.join(sorted(present))}"
        )
    keys = training_keys([d for _, d in loaded], excluded)
    refs = [
        {"bundle": n, "sha256": sha256_hex(data)}
        for n, (data, _) in zip(names, loaded, strict=True)
    ]
    check, check_ref = None, None
    if calibrate_on is not None:
        check, check_ref = _calibration_check(Path(calibrate_on), refs, fps[0])
    result = train(keys, version=FEATURE_VERSION[SCHEMA_VERSION], check=check)
    doc = build_model(
        refs, result, keys, milestone=out.name, fingerprint_hash=fps[0], excluded=excluded,
        libraries=trained_with(),
    )  # fmt: skip
    if check_ref is not None:
        doc["calibrated_on"] = check_ref
    doc = PerfModelDoc.model_validate(doc).to_json_dict()
    PerfModel.from_doc(doc, MODEL_FILE)  # what answering loads
    return publish_bundle(
        out,
        fingerprint=fp,
        files={"fingerprint.json": fp_doc, MODEL_FILE: doc, REPORT_FILE: render(doc)},
        milestone=out.name,
    )


def check_mismatch(
    doc: Mapping[str, Any], sweeps: Sequence[Mapping[str, Any]], fingerprint_hash: str
) -> str | None:
    """Why a check document cannot calibrate a model of these sweeps and host (None: it can)."""
    if doc.get("fingerprint_hash") != fingerprint_hash:
        return (
            f"it was measured in environment {doc.get('fingerprint_hash')}, the sweeps in "
            f"{fingerprint_hash}"
        )
    ref = doc.get("sweep") or {}
    if ref.get("sha256") not in {s["sha256"] for s in sweeps}:
        return (
            f"its plan comes from a model of sweep {ref.get('bundle')} "
            f"({str(ref.get('sha256'))[:12]}), not of the sweeps trained on"
        )
    return None


def _calibration_check(
    path: Path, sweeps: Sequence[Mapping[str, Any]], fingerprint_hash: str
) -> tuple[list[CheckPoint], dict[str, str]]:
    data, doc = _load_bundle_doc(
        path, CHECK_FILE, CHECK_SCHEMA, "held-out check (benchmarks/perf_check.py publish)"
    )
    why = check_mismatch(doc, sweeps, fingerprint_hash)
    if why is not None:
        raise UsageError(f"cannot calibrate on {path}: {why}")
    return check_points(doc), {"bundle": path.resolve().name, "sha256": sha256_hex(data)}


def render(doc: Mapping[str, Any]) -> str:
    """``report/model.md``: a view of ``model.json`` (the audit checks the JSON)."""
    t = doc["training"]
    g = doc["gate"]
    m = doc["model"]
    excluded = ", ".join(doc["excluded"]) or "none"
    lines = [
        "# Learned performance model",
        "",
        f"Trained on {t['keys']} sweep keys ({t['rows']} timed configs) of {len(t['families'])} "
        f"families: {', '.join(t['families'])}. Left out: {excluded}. Sweeps: "
        + ", ".join(f"{s['bundle']} ({s['sha256'][:12]})" for s in doc["sweeps"])
        + ".",
        "",
        "Leave-one-family-out comparison of the model classes: at every key of each family, the "
        "class trained on the other families chose a config, which the sweep had timed. "
        "Dispatch: the geomean speedup over FlagGems' choice of the answers the gate lets "
        "through (a fallback counts 1.0); chosen: every choice, ungated; best: the best "
        "config the sweep timed.",
        "",
        "| class | dispatch geomean | answered | slower | calibration error | chosen geomean | "
        "best geomean | keys |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in sorted(t["classes"]):
        s = t["classes"][name]
        mark = " (chosen)" if name == t["chosen"] else ""
        lines.append(
            f"| {name}{mark} | {cell(s['dispatch'], '.4f')} | {s['answered']} | {s['slower']} | "
            f"{cell(s['calibration_error'], '.4f')} | {cell(s['chosen'], '.4f')} | "
            f"{cell(s['best'], '.4f')} | {s['points']} |"
        )
    nodes = sum(len(tree["left"]) for tree in m["trees"])
    lines += [
        "",
        f"Gate: an answer needs a calibrated confidence of at least {g['min_confidence']:g} and "
        f"a predicted lower-quartile speedup of at least {g['min_speedup']:g}; otherwise "
        "FlagGems' own choice.",
        "",
        *_gate_lines(t),
        f"Chosen class: {t['chosen']}, trained again on every family: {len(m['trees'])} trees, "
        f"{nodes} nodes, {m['n_features']} features. {_confidence_line(doc)}",
        "",
        "Shape families the model was trained on: " + ", ".join(doc["shape_families"]) + ".",
    ]
    return "\n".join(lines) + "\n"


def _sign(x: float) -> str:
    return f"{'-' if x < 0 else '+'} {abs(x):.4f}"


def _confidence_line(doc: Mapping[str, Any]) -> str:
    """How the stated confidence is computed, and from what it was fitted."""
    cal = doc["calibration"]
    check = doc.get("calibrated_on")
    if check is None:
        return (
            f"Confidence: P(faster) = 1 / (1 + exp(-({cal['a']:.4f} x agreement "
            f"{_sign(cal['b'])}))), where agreement is the share of trees predicting the choice "
            f"faster by the margin; fitted on {cal['n']} leave-one-family-out choices."
        )
    return (
        f"Confidence: P(faster) = 1 / (1 + exp(-({cal['c']:.4f} x log(predicted) "
        f"{_sign(cal['d'])} x [predicted >= {cal['step']:g}] {_sign(cal['b'])}))), fitted on the "
        f"{cal['n']} timed leave-one-family-out choices of the held-out check {check['bundle']} "
        f"({check['sha256'][:12]}); a family's confidence in a check of this model comes from "
        "the map fitted on the other families' choices (training.check_calibrations)."
    )


def _gate_lines(t: Mapping[str, Any]) -> list[str]:
    """How each class's gate was chosen (schema 1.1; nothing for 1.0's fixed gate)."""
    from mxdb.costmodel.train import GATE_GUARD

    steps = t.get("gate_steps")
    if not steps:
        return []
    lines = [
        f"The gate's predicted speedup (feature set {t.get('feature_version')}) was chosen per "
        "class from its leave-one-family-out answers: the smallest step at which no gated "
        f"answer measured slower than FlagGems' choice, raised by {GATE_GUARD} step(s), since "
        "the sweep times one routing instance per key.",
        "",
        "| class | min speedup | dispatch geomean | answered | slower |",
        "|---|---|---|---|---|",
    ]
    for name in sorted(steps):
        for st in steps[name]:
            lines.append(
                f"| {name} | {cell(st['min_speedup'], '.2f')} | {cell(st['dispatch'], '.4f')} | "
                f"{st['answered']} | {st['slower']} |"
            )
    return [*lines, ""]
