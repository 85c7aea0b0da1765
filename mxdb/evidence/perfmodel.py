"""The learned performance model as evidence (``model.json``, ``mxdb.perf-model`` 1.1).

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

Training is deterministic (fixed seeds, one thread), so ``mxdb audit`` trains again from the
same sweeps and compares (:mod:`mxdb.audit.perfmodel`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from mxdb.costmodel.features import FEATURE_SETS
from mxdb.errors import UsageError
from mxdb.evidence.cells import cell
from mxdb.evidence.models import _HEX16, _HEX64, _ID, KNOWN_VERSIONS, _Doc, optional_fields
from mxdb.evidence.sweep import SCHEMA as SWEEP_SCHEMA
from mxdb.evidence.sweep import SWEEP_FILE

MODEL_FILE = "model.json"
REPORT_FILE = "report/model.md"
SCHEMA = "mxdb.perf-model"
SCHEMA_VERSION = "1.1"
#: schema version -> the feature set (and gate rule) its models are trained with
FEATURE_VERSION: dict[str, int] = {"1.0": 1, "1.1": 2}

# the versions of this document the audit understands
KNOWN_VERSIONS.setdefault(SCHEMA, tuple(FEATURE_VERSION))


def feature_version(doc: Mapping[str, Any]) -> int:
    """The feature set a model document of any known schema version was trained with."""
    return FEATURE_VERSION.get(str(doc.get("schema_version")), FEATURE_VERSION[SCHEMA_VERSION])


class SweepRef(_Doc):
    """A sweep bundle the model was trained on."""

    bundle: str = Field(pattern=_ID, description="the sweep bundle's folder, beside this bundle")
    sha256: str = Field(pattern=_HEX64, description="SHA-256 of its sweep.json")


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
    """Platt scaling of the trees' agreement (:mod:`mxdb.costmodel.calibration`)."""

    a: float
    b: float
    n: int = Field(ge=0, description="the outcomes it was fitted on")


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

    model_config = optional_fields("feature_version", "gate_steps")  # 1.0 has neither

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


class PerfModelDoc(_Doc):
    """``model.json``: a learned performance model (module docstring)."""

    schema_name: Literal["mxdb.perf-model"] = Field(default="mxdb.perf-model", alias="schema")
    schema_version: Literal["1.0", "1.1"] = "1.1"
    milestone: str
    fingerprint_hash: str = Field(pattern=_HEX16)
    sweeps: list[SweepRef] = Field(min_length=1)
    excluded: list[str] = Field(description="preset names of the families left out")
    shape_families: list[str]
    feature_names: list[str]
    model: ForestDoc
    calibration: CalibrationDoc
    gate: GateDoc
    training: TrainingDoc
    trained_with: dict[str, str] = Field(description="library versions that trained the model")


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


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _load_sweep(path: Path) -> tuple[bytes, dict[str, Any]]:
    from mxdb.fileio import MAX_DOCUMENT_BYTES, parse_json, read_bytes

    f = path / SWEEP_FILE
    if not f.is_file():
        raise UsageError(
            f"{path} is not a performance sweep bundle: it has no {SWEEP_FILE} (write one with "
            "benchmarks/perf_sweep.py publish)"
        )
    data = read_bytes(f, limit=MAX_DOCUMENT_BYTES, what="sweep", error=UsageError)
    doc = parse_json(data, what=str(f), error=UsageError)
    if not isinstance(doc, dict) or doc.get("schema") != SWEEP_SCHEMA:
        found = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise UsageError(f"{f} is not a performance sweep: schema {found!r}, not {SWEEP_SCHEMA!r}")
    return data, doc


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


def write_model_bundle(sweeps: Sequence[Path], out: Path, *, exclude: Sequence[str] = ()) -> Path:
    """Train the model on the sweep bundles ``sweeps`` (less the families ``exclude`` names)
    and write its bundle to ``out``, which must lie in the same folder as the sweeps (the
    audit finds them there); returns ``out``."""
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
    away = [str(p) for p in paths if p.resolve().parent != home]
    if away:
        raise UsageError(
            f"the sweep bundles must lie in the model bundle's folder {home} (the audit finds "
            f"them beside it by name); not there: {', '.join(away)}"
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
    result = train(keys, version=FEATURE_VERSION[SCHEMA_VERSION])
    refs = [
        {"bundle": n, "sha256": sha256_hex(data)}
        for n, (data, _) in zip(names, loaded, strict=True)
    ]
    doc = build_model(
        refs, result, keys, milestone=out.name, fingerprint_hash=fps[0], excluded=excluded,
        libraries=trained_with(),
    )  # fmt: skip
    doc = PerfModelDoc.model_validate(doc).to_json_dict()
    PerfModel.from_doc(doc, MODEL_FILE)  # what answering loads
    return publish_bundle(
        out,
        fingerprint=fp,
        files={"fingerprint.json": fp_doc, MODEL_FILE: doc, REPORT_FILE: render(doc)},
        milestone=out.name,
    )


def render(doc: Mapping[str, Any]) -> str:
    """``report/model.md``: a view of ``model.json`` (the audit checks the JSON)."""
    t = doc["training"]
    g = doc["gate"]
    cal = doc["calibration"]
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
        f"{nodes} nodes, {m['n_features']} features. Confidence: P(faster) = 1 / (1 + "
        f"exp(-({cal['a']:.4f} x agreement {'-' if cal['b'] < 0 else '+'} {abs(cal['b']):.4f}"
        f"))), where agreement is the share of trees predicting the choice faster by the "
        f"margin; fitted on {cal['n']} leave-one-family-out choices.",
        "",
        "Shape families the model was trained on: " + ", ".join(doc["shape_families"]) + ".",
    ]
    return "\n".join(lines) + "\n"


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
