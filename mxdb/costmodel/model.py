"""A trained performance model, loaded for answering: its best config for a key, gated.

The model file is the ``model.json`` of a ``mxdb.perf-model`` bundle (``mxdb model train``):
the forest as plain data, the calibration of its confidence, the gate, the fingerprint of the
host whose sweeps trained it, and the families it was trained on.  Answering needs numpy only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mxdb.costmodel.train import Choice, Gate, choose
from mxdb.errors import UsageError
from mxdb.shapes import MoEShape

#: the document a model file holds
MODEL_SCHEMA = "mxdb.perf-model"


@dataclass(frozen=True)
class PerfModel:
    """A loaded model (see the module doc)."""

    forest: Mapping[str, Any]
    calibration: Mapping[str, Any]
    gate: Gate
    fingerprint_hash: str
    #: shape families (``MoEShape.family``) the sweeps measured
    families: frozenset[str]
    path: str | None = None

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any], path: str | None = None) -> PerfModel:
        if doc.get("schema") != MODEL_SCHEMA:
            raise UsageError(
                f"{path or 'the document'} is not a performance model: schema is "
                f"{doc.get('schema')!r}, expected {MODEL_SCHEMA!r} (the model.json of a bundle "
                "written by 'mxdb model train')"
            )
        try:
            g = doc["gate"]
            return cls(
                forest=doc["model"],
                calibration=doc["calibration"],
                gate=Gate(float(g["min_confidence"]), float(g["min_speedup"])),
                fingerprint_hash=str(doc["fingerprint_hash"]),
                families=frozenset(str(f) for f in doc["shape_families"]),
                path=path,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UsageError(f"{path or 'the model document'} is malformed: {exc}") from None

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
