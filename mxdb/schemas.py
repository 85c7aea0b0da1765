"""JSON Schemas (2020-12) of every file mxdb writes or reads, generated from the models.

The committed copies live in ``schemas/<name>/<version>/<name>.schema.json`` at the top of
the repository; ``python -m mxdb.schemas --write`` regenerates them and ``--check`` exits 1
when a committed copy drifts from its model.  A model that is not importable yet (a module
still to come) is reported and skipped, never an error.

The auditor validates with ``jsonschema`` against the committed copy when it is present
(else the generated one): see :func:`validator`.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import sys
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped,unused-ignore]

DIALECT = "https://json-schema.org/draft/2020-12/schema"

#: name -> (model "module:Class", schema version, pydantic JSON-schema mode)
REGISTRY: dict[str, tuple[str, str, str]] = {
    "workload": ("mxdb.tune.workload:Workload", "1.5", "validation"),
    "trace": ("mxdb.evidence.models:TraceDoc", "1.0", "serialization"),
    "run": ("mxdb.evidence.models:RunRecord", "1.3", "serialization"),
    "manifest": ("mxdb.evidence.models:Manifest", "1.0", "serialization"),
    "fingerprint": ("mxdb.evidence.models:FingerprintDoc", "1.1", "serialization"),
    "signature": ("mxdb.evidence.models:SignatureDoc", "1.0", "serialization"),
    "summary": ("mxdb.evidence.models:Summary", "1.1", "serialization"),
    "report": ("mxdb.evidence.models:Report", "1.0", "serialization"),
    "store-export": ("mxdb.interop.export:StoreExport", "1.3", "serialization"),
    "compile-survey": ("mxdb.evidence.survey:CompileSurvey", "1.1", "serialization"),
    "decode": ("mxdb.evidence.decode:DecodeDoc", "1.0", "serialization"),
    "peers": ("mxdb.evidence.peers:PeersDoc", "1.5", "serialization"),
    "lean-layer": ("mxdb.evidence.lean_layer:LeanLayerDoc", "1.0", "serialization"),
    "self-healing": ("mxdb.evidence.healing:SelfHealingDoc", "1.0", "serialization"),
    "serving": ("mxdb.evidence.serving:ServingDoc", "1.1", "serialization"),
    "stages": ("mxdb.evidence.stages:StagesDoc", "1.1", "serialization"),
    "perf-check": ("mxdb.evidence.perfcheck:CheckDoc", "1.0", "serialization"),
    "perf-sweep": ("mxdb.evidence.sweep:SweepDoc", "1.0", "serialization"),
    "perf-model": ("mxdb.evidence.perfmodel:PerfModelDoc", "1.2", "serialization"),
}

#: The document name a file declares in its "schema" field -> registry name.
DOCUMENT_NAMES: dict[str, str] = {
    "mxdb.workload": "workload",
    "mxdb.trace": "trace",
    "mxdb.run": "run",
    "mxdb.manifest": "manifest",
    "mxdb.fingerprint": "fingerprint",
    "mxdb.signature": "signature",
    "mxdb.summary": "summary",
    "mxdb.report": "report",
    "mxdb.store-export": "store-export",
    "mxdb.compile-survey": "compile-survey",
    "mxdb.decode": "decode",
    "mxdb.peers": "peers",
    "mxdb.lean-layer": "lean-layer",
    "mxdb.self-healing": "self-healing",
    "mxdb.serving": "serving",
    "mxdb.stages": "stages",
    "mxdb.perf-check": "perf-check",
    "mxdb.perf-sweep": "perf-sweep",
    "mxdb.perf-model": "perf-model",
}


def schema_root() -> Path:
    """The committed ``schemas/`` directory (next to the ``mxdb`` package in a checkout)."""
    return Path(__file__).resolve().parent.parent / "schemas"


def schema_path(name: str, version: str, root: Path | None = None) -> Path:
    return (root or schema_root()) / name / version / f"{name}.schema.json"


def _load_model(target: str) -> Any | None:
    module, _, attr = target.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None


def generate(name: str) -> dict[str, Any] | None:
    """The JSON Schema of a registered model, or ``None`` while the model does not exist."""
    target, version, mode = REGISTRY[name]
    model = _load_model(target)
    if model is None:
        return None
    body = model.model_json_schema(mode=mode)
    schema: dict[str, Any] = {
        "$schema": DIALECT,
        "$id": f"urn:mxdb:schema:{name}:{version}",
        "x-mxdb-model": target,
        "x-mxdb-version": version,
    }
    schema.update(body)
    return schema


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def write_all(root: Path | None = None) -> tuple[list[Path], list[str]]:
    """Write every available schema; returns (paths written, names whose model is missing)."""
    from mxdb.evidence.files import atomic_write

    written, missing = [], []
    for name, (_, version, _) in REGISTRY.items():
        schema = generate(name)
        if schema is None:
            missing.append(name)
            continue
        path = schema_path(name, version, root)
        atomic_write(path, render(schema).encode())
        written.append(path)
    return written, missing


def check_all(root: Path | None = None) -> tuple[list[str], list[str]]:
    """Compare committed schemas with the models; returns (drift messages, missing models)."""
    drift, missing = [], []
    for name, (target, version, _) in REGISTRY.items():
        schema = generate(name)
        if schema is None:
            missing.append(name)
            continue
        path = schema_path(name, version, root)
        if not path.is_file():
            drift.append(
                f"{path}: not committed (model {target}); run python -m mxdb.schemas --write"
            )
        elif path.read_text() != render(schema):
            drift.append(
                f"{path}: differs from model {target}; if the change is intended, bump the "
                "version when the format changed, then run python -m mxdb.schemas --write"
            )
    return drift, missing


@functools.cache
def load_schema(name: str, version: str | None = None) -> dict[str, Any] | None:
    """The schema the auditor uses for ``version`` (default: the current one).

    The committed file of that version if present (an older document is validated against
    the schema it was written under), else the one generated from the current model.
    """
    _, current, _ = REGISTRY[name]
    path = schema_path(name, version or current)
    if version is not None and version != current and not path.is_file():
        path = schema_path(name, current)
    if path.is_file():
        loaded: dict[str, Any] = json.loads(path.read_text())
        return loaded
    return generate(name)


@functools.cache
def validator(name: str, version: str | None = None) -> Any:
    """A compiled 2020-12 validator for a registered schema (``None`` when unavailable)."""
    schema = load_schema(name, version)
    if schema is None:
        return None
    cls: Any = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mxdb.schemas", description=__doc__)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", action="store_true", help="regenerate the committed schemas")
    group.add_argument("--check", action="store_true", help="exit 1 if a committed schema drifts")
    parser.add_argument("--root", type=Path, default=None, help="schemas dir (default: repo's)")
    args = parser.parse_args(argv)
    if args.write:
        written, missing = write_all(args.root)
        for p in written:
            print(f"wrote {p}")
    else:
        drift, missing = check_all(args.root)
        for msg in drift:
            print(msg, file=sys.stderr)
        if not drift:
            print(f"{len(REGISTRY) - len(missing)} schemas match their models")
    for name in missing:
        print(f"skipped {name}: model {REGISTRY[name][0]} is not available yet", file=sys.stderr)
    return 1 if (args.check and drift) else 0


if __name__ == "__main__":
    sys.exit(main())
