"""A trained performance model, loaded for answering: its best config for a key, gated.

The model file is the ``model.json`` of a ``mxdb.perf-model`` bundle (``mxdb model train``):
the forest as plain data, the calibration of its confidence, the gate, the fingerprint of the
host whose sweeps trained it, and the families it was trained on.  Answering needs numpy only.
A model is checked once, when it is built
(:func:`mxdb.costmodel.trees.validate`: acyclic trees of bounded depth and size, every node of
the right type, the feature count a known feature set's), so that answering is bounded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mxdb.costmodel import trees
from mxdb.costmodel.features import FEATURE_SETS, version_of
from mxdb.costmodel.train import Choice, Gate, choose
from mxdb.errors import UsageError
from mxdb.shapes import MoEShape

#: the document a model file holds
MODEL_SCHEMA = "mxdb.perf-model"


def _number(value: Any, what: str) -> float:
    """``value`` as a finite float (not a bool), else a UsageError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UsageError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _check_calibration(cal: Any) -> None:
    if not isinstance(cal, Mapping):
        raise UsageError(f"its calibration is a {type(cal).__name__}, not an object")
    if "a" not in cal or "b" not in cal:
        raise UsageError("its calibration lacks the numbers 'a' and 'b'")
    for k in ("a", "b", *(("c", "d", "step") if "c" in cal else ())):
        _number(cal.get(k), f"calibration {k!r}")
    if "c" in cal and not float(cal["step"]) > 0:
        raise UsageError(f"calibration 'step' must be > 0, got {cal['step']!r}")


@dataclass(frozen=True)
class PerfModel:
    """A loaded model (see the module doc); built only from what passes the checks."""

    forest: Mapping[str, Any]
    calibration: Mapping[str, Any]
    gate: Gate
    fingerprint_hash: str
    #: shape families (``MoEShape.family``) the sweeps measured
    families: frozenset[str]
    path: str | None = None

    def __post_init__(self) -> None:
        where = self.path or "the performance model"
        try:
            if not isinstance(self.forest, Mapping):
                raise UsageError(f"its model is a {type(self.forest).__name__}, not an object")
            version_of(self.forest.get("n_features"))
            trees.validate(self.forest)
            _check_calibration(self.calibration)
            _number(self.gate.min_confidence, "gate min_confidence")
            _number(self.gate.min_speedup, "gate min_speedup")
            if not isinstance(self.fingerprint_hash, str) or not self.fingerprint_hash:
                raise UsageError("it names no fingerprint_hash")
        except UsageError as exc:
            raise UsageError(f"{where}: {exc}") from None

    @classmethod
    def from_doc(cls, doc: Any, path: str | None = None) -> PerfModel:
        where = path or "the performance model"
        if not isinstance(doc, Mapping):
            raise UsageError(
                f"{where} is not a performance model: it holds a {type(doc).__name__}, not an "
                f"object (the model.json of a bundle written by 'mxdb model train')"
            )
        if doc.get("schema") != MODEL_SCHEMA:
            raise UsageError(
                f"{where} is not a performance model: schema is "
                f"{doc.get('schema')!r}, expected {MODEL_SCHEMA!r} (the model.json of a bundle "
                "written by 'mxdb model train')"
            )
        try:
            g = doc["gate"]
            fams = doc["shape_families"]
            if not isinstance(fams, list) or not all(isinstance(f, str) for f in fams):
                raise TypeError("shape_families must be a list of family names")
            model = doc["model"]
            names = doc.get("feature_names")
            if names is not None and isinstance(model, Mapping):
                known = FEATURE_SETS.get(version_of(model.get("n_features")))
                if list(names) != list(known or ()):
                    raise UsageError(
                        f"{where}: its feature_names are not the feature set of "
                        f"{model.get('n_features')!r} features this version of mxdb computes: "
                        "train it again (mxdb model train)"
                    )
            return cls(
                forest=model,
                calibration=doc["calibration"],
                gate=Gate(
                    _number(g["min_confidence"], "gate min_confidence"),
                    _number(g["min_speedup"], "gate min_speedup"),
                ),
                fingerprint_hash=doc["fingerprint_hash"],
                families=frozenset(fams),
                path=path,
            )
        except UsageError as exc:
            msg = str(exc)
            raise UsageError(msg if msg.startswith(where) else f"{where}: {msg}") from None
        except (KeyError, TypeError, ValueError) as exc:
            raise UsageError(f"{where} is malformed: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> PerfModel:
        from mxdb.fileio import load_json

        p = Path(path)
        return cls.from_doc(load_json(p, what="performance model", error=UsageError), str(p))

    def choice(self, shape: MoEShape, routing_class: str) -> Choice:
        """The model's choice at the key, with its calibrated confidence (not yet gated)."""
        return choose(self.forest, shape, routing_class, self.calibration)

    def answer(self, shape: MoEShape, routing_class: str) -> Choice | None:
        """The choice when the gate admits it, else None (the fallback)."""
        ch = self.choice(shape, routing_class)
        return ch if self.gate.admits(ch) else None
