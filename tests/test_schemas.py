"""Committed JSON Schemas match their models; the audit's fast path agrees with jsonschema."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mxdb import schemas
from mxdb.audit.fastschema import compile_schema
from mxdb.evidence.synthetic import synthetic_bundle

AVAILABLE = [n for n in schemas.REGISTRY if schemas.generate(n) is not None]


@pytest.mark.parametrize("name", sorted(schemas.REGISTRY))
def test_committed_schema_matches_model(name: str) -> None:
    generated = schemas.generate(name)
    if generated is None:
        pytest.skip(f"model {schemas.REGISTRY[name][0]} not available yet")
    _, version, _ = schemas.REGISTRY[name]
    path = schemas.schema_path(name, version)
    assert path.is_file(), f"{path} not committed: run python -m mxdb.schemas --write"
    assert path.read_text() == schemas.render(generated), f"{path} drifted from its model"
    loaded = json.loads(path.read_text())
    assert loaded["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert loaded["$id"] == f"urn:mxdb:schema:{name}:{version}"
    jsonschema.Draft202012Validator.check_schema(loaded)


def test_check_entry_point_detects_drift(tmp_path: Path) -> None:
    written, _ = schemas.write_all(tmp_path)
    assert written
    cmd = [sys.executable, "-m", "mxdb.schemas", "--check", "--root", str(tmp_path)]
    assert subprocess.run(cmd, capture_output=True).returncode == 0
    target = schemas.schema_path("run", schemas.REGISTRY["run"][1], tmp_path)
    doc = json.loads(target.read_text())
    doc["properties"].pop("seed")
    target.write_text(json.dumps(doc))
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 1 and "run.schema.json" in res.stderr


@pytest.fixture(scope="module")
def docs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = synthetic_bundle(tmp_path_factory.mktemp("s") / "b", groups=2, runs_per_group=6)
    load = lambda rel: json.loads((root / rel).read_text())  # noqa: E731
    return {
        "run": load("runs/g0000-c000.json"),
        "summary": load("summary.json"),
        "manifest": load("manifest.json"),
        "report": load("report/report.json"),
        "fingerprint": load("fingerprint.json"),
        "store-export": load("store_export.json"),
        "trace": load(next(p.relative_to(root).as_posix() for p in (root / "traces").iterdir())),
    }


def test_written_documents_validate(docs: dict[str, dict[str, Any]]) -> None:
    for name, doc in docs.items():
        schema = schemas.load_schema(name, str(doc.get("schema_version")))
        assert schema is not None
        jsonschema.Draft202012Validator(schema).validate(doc)
        fast = compile_schema(schema)
        assert fast is not None and fast(doc), name


JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    st.floats(allow_nan=True, allow_infinity=False),
    st.text(max_size=4),
    st.just([]),
    st.just({}),
    st.lists(st.integers(0, 3), max_size=3),
)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:3]):
            out += _paths(v, (*prefix, i))
    return out


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_fast_path_agrees_with_jsonschema(docs: dict[str, dict[str, Any]], data: Any) -> None:
    name = data.draw(st.sampled_from(sorted(docs)))
    doc = copy.deepcopy(docs[name])
    path = data.draw(st.sampled_from(_paths(doc)[1:]))
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    action = data.draw(st.sampled_from(["set", "delete", "add"]))
    if action == "delete" and isinstance(parent, dict):
        parent.pop(path[-1])
    elif action == "add" and isinstance(parent, dict):
        parent["unexpected_key"] = data.draw(JSON_VALUES)
    else:
        parent[path[-1]] = data.draw(JSON_VALUES)
    schema = schemas.load_schema(name)
    assert schema is not None
    fast = compile_schema(schema)
    assert fast is not None
    assert fast(doc) == jsonschema.Draft202012Validator(schema).is_valid(doc)
