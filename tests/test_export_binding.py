"""Every exported entry is bound to its evidence: the audit on copies of committed evidence.

One field of a real entry is changed at a time (its key, its device, a held-out validation
record's token count or routing class, its status, a figure), in a bundle's
``store_export.json`` (run schema 1.3, 1.2 and 1.0, an entry resting on another bundle's run)
and in the shipped ``evidence/store-export.json`` (fused-MoE and decode-op entries); the real
audit must name that field each time, and the unchanged copies must audit clean.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mxdb.audit import audit_paths
from mxdb.errors import InvalidInputError
from mxdb.interop.export import read_export
from mxdb.models import ROUTING_CLASSES

EVIDENCE = Path(__file__).resolve().parents[1] / "evidence"
#: run schema 1.3; its entries (one with held-out validation) are in the shipped export
SKEWED = "h200-peers-skewed2-20261201T111158Z-48d8"
#: run schema 1.3; its one entry is in the shipped export
HOT4096 = "h200-peers-hot4096-20261201T180107Z-21be"
#: run schema 1.2, one tune in two bundles: one entry of the first rests on a run of the second
TIES = ("h200-ties-hot0.5e0-20261201T030102Z-37e4", "h200-ties-uniform-20261201T030102Z-2e3e")
#: run schema 1.0
LEGACY = "h200-milestone-uniform-20261130T022124Z-6ea9"
DECODE = "h200-decode-ops"
SHIPPED = "store-export.json"

Entry = dict[str, Any]


def _other(value: Any, choices: tuple[Any, ...]) -> Any:
    return next(c for c in choices if c != value)


def _set(**changes: Callable[[Entry], Any]) -> Callable[[Entry], bool]:
    """A change of an entry's top-level fields, each computed from the entry."""

    def change(e: Entry) -> bool:
        e.update({k: f(e) for k, f in changes.items()})
        return True

    return change


def _record(name: str, value: Callable[[Any], Any]) -> Callable[[Entry], bool]:
    """A change of the first held-out validation record; False for an entry without one."""

    def change(e: Entry) -> bool:
        if not e.get("validation"):
            return False
        rec = e["validation"][0]
        rec[name] = value(rec[name])
        return True

    return change


def _verified_to_rejected(e: Entry) -> bool:
    if e["status"] != "verified":
        return False
    e["status"] = "rejected"
    return True


#: name -> (field the finding must name, change: False where it does not apply to the entry)
MUTATIONS: dict[str, tuple[str, Callable[[Entry], bool]]] = {
    "family": ("family", _set(family=lambda e: e["family"] + "0")),
    "dims": (
        "dims",
        _set(dims=lambda e: {k: v + (k != "tokens") for k, v in e["dims"].items()}),
    ),
    "tokens": ("tokens", _set(tokens=lambda e: e["tokens"] * 2)),
    "routing_class": (
        "routing_class",
        _set(routing_class=lambda e: _other(e["routing_class"], ROUTING_CLASSES)),
    ),
    "dtype": ("dtype", _set(dtype=lambda e: _other(e["dtype"], ("bf16", "fp16")))),
    "fingerprint": ("fingerprint_hash", _set(fingerprint_hash=lambda e: "0" * 16)),
    "device": ("device_name", _set(device_name=lambda e: "NVIDIA A100")),
    "speedup": ("speedup", _set(speedup=lambda e: 9.0)),
    "rejected": ("status", _verified_to_rejected),
    "status": (
        "status",
        _set(status=lambda e: "baseline" if e["status"] == "verified" else "verified"),
    ),
    "validation.tokens": ("validation[0].tokens", _record("tokens", lambda t: t * 2)),
    "validation.routing_class": (
        "validation[0].routing_class",
        _record("routing_class", lambda c: _other(c, ROUTING_CLASSES)),
    ),
}
#: From run schema 1.1 on a later trace may have rejected a verified entry: not a finding.
NEW_SCHEMA = [m for m in MUTATIONS if m != "rejected"]
SETTINGS = settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the bundles the tests audit, and of the shipped export's entries they back."""
    root = tmp_path_factory.mktemp("binding")
    for name in (SKEWED, HOT4096, *TIES, LEGACY, DECODE):
        shutil.copytree(EVIDENCE / name, root / name)
    return root


def _shipped_subset(tree: Path) -> dict[str, Any]:
    """The shipped export limited to the entries of the copied bundles (decode ones and the
    fused-MoE entries whose evidence run is in SKEWED or HOT4096)."""
    doc = json.loads((EVIDENCE / SHIPPED).read_text())
    runs = {p.stem for b in (SKEWED, HOT4096) for p in (tree / b / "runs").glob("*.json")}
    doc["entries"] = [
        e for e in doc["entries"] if e["op"] != "fused_moe" or e.get("evidence") in runs
    ]
    return doc


def _audit(paths: list[Path]) -> list[tuple[str, str, str]]:
    return [(f.check, f.file, f.field) for f in audit_paths(paths).findings]


def _named(found: list[tuple[str, str, str]], code: str, field: str) -> bool:
    return any(c == code and f == field for c, _, f in found)


def _entries(bundle: str) -> list[Entry]:
    return list(json.loads((EVIDENCE / bundle / "store_export.json").read_text())["entries"])


def test_unchanged_copies_audit_clean(tree: Path) -> None:
    (tree / SHIPPED).write_text(json.dumps(_shipped_subset(tree)))
    try:
        found = _audit([tree])
    finally:
        (tree / SHIPPED).unlink()
    assert found == []
    assert len(_shipped_subset(tree)["entries"]) >= 15  # decode and fused-MoE entries audited


def _mutate_and_audit(
    tree: Path, names: tuple[str, ...], bundle: str, i: int, mutation: str
) -> list[tuple[str, str, str]]:
    path = tree / bundle / "store_export.json"
    original = path.read_bytes()
    doc = json.loads(original)
    assert MUTATIONS[mutation][1](doc["entries"][i]), f"{mutation} does not apply"
    try:
        path.write_text(json.dumps(doc))
        return _audit([tree / n for n in names])
    finally:
        path.write_bytes(original)


@SETTINGS
@given(data=st.data())
def test_bundle_entry_field_is_bound(tree: Path, data: st.DataObject) -> None:
    bundle = data.draw(st.sampled_from([SKEWED, HOT4096]))
    i = data.draw(st.integers(0, len(_entries(bundle)) - 1))
    mutation = data.draw(st.sampled_from(NEW_SCHEMA))
    if not MUTATIONS[mutation][1](copy.deepcopy(_entries(bundle)[i])):
        return  # the change does not apply to this entry (no validation records)
    found = _mutate_and_audit(tree, (bundle,), bundle, i, mutation)
    field = MUTATIONS[mutation][0]
    assert _named(found, "store_export.field_mismatch", f"entries[{i}].{field}"), found


@pytest.mark.parametrize("mutation", ["family", "tokens", "routing_class", "dtype", "rejected"])
def test_legacy_entry_field_is_bound(tree: Path, mutation: str) -> None:
    entries = _entries(LEGACY)
    i = next(k for k, e in enumerate(entries) if e["status"] == "verified")
    found = _mutate_and_audit(tree, (LEGACY,), LEGACY, i, mutation)
    assert _named(found, "store_export.field_mismatch", f"entries[{i}].{MUTATIONS[mutation][0]}")


def test_legacy_figure_is_checked(tree: Path) -> None:
    i = 0
    found = _mutate_and_audit(tree, (LEGACY,), LEGACY, i, "speedup")
    assert _named(found, "store_export.field_mismatch", f"entries[{i}].speedup"), found


def test_legacy_copy_to_another_key_is_a_finding(tree: Path) -> None:
    """A verified entry copied beside itself to another token count: the copy names its field."""
    path = tree / LEGACY / "store_export.json"
    original = path.read_bytes()
    doc = json.loads(original)
    i = next(k for k, e in enumerate(doc["entries"]) if e["status"] == "verified")
    dup = copy.deepcopy(doc["entries"][i])
    dup["tokens"] *= 2
    dup["dims"]["tokens"] = dup["tokens"]
    doc["entries"].append(dup)
    try:
        path.write_text(json.dumps(doc))
        found = _audit([tree / LEGACY])
    finally:
        path.write_bytes(original)
    n = len(doc["entries"]) - 1
    assert _named(found, "store_export.field_mismatch", f"entries[{n}].tokens"), found
    assert _named(found, "store_export.field_mismatch", f"entries[{n}].dims"), found


def test_exact_duplicate_entry_is_a_finding(tree: Path) -> None:
    path = tree / SKEWED / "store_export.json"
    original = path.read_bytes()
    doc = json.loads(original)
    doc["entries"].append(copy.deepcopy(doc["entries"][0]))
    try:
        path.write_text(json.dumps(doc))
        found = _audit([tree / SKEWED])
    finally:
        path.write_bytes(original)
    assert _named(found, "store_export.duplicate_entry", f"entries[{len(doc['entries']) - 1}]")


@pytest.mark.parametrize("mutation", ["family", "tokens", "validation.tokens", "speedup"])
def test_entry_resting_on_another_bundle_is_bound(tree: Path, mutation: str) -> None:
    """An entry whose evidence run is in another bundle of its tune is compared field by field
    with that run's decision."""
    first = TIES[0]
    res = audit_paths([tree / first])  # alone, its entry of the other bundle is unbacked
    assert [f.check for f in res.findings] == ["store_export.unbacked_entry"]
    i = int(res.findings[0].field.removeprefix("entries[").rstrip("]"))
    found = _mutate_and_audit(tree, TIES, first, i, mutation)
    file = f"{(tree / first).as_posix()}/store_export.json"
    field = f"entries[{i}].{MUTATIONS[mutation][0]}"
    assert ("store_export.field_mismatch", file, field) in found, found


def _shipped_case(tree: Path, i: int, mutation: str) -> list[tuple[str, str, str]] | None:
    doc = _shipped_subset(tree)
    if not MUTATIONS[mutation][1](doc["entries"][i]):
        return None
    (tree / SHIPPED).write_text(json.dumps(doc))
    try:
        return _audit([tree])
    finally:
        (tree / SHIPPED).unlink()


@SETTINGS
@given(data=st.data())
def test_shipped_entry_field_is_bound(tree: Path, data: st.DataObject) -> None:
    entries = _shipped_subset(tree)["entries"]
    i = data.draw(st.integers(0, len(entries) - 1))
    mutation = data.draw(st.sampled_from(list(MUTATIONS)))
    found = _shipped_case(tree, i, mutation)
    if found is None:
        return  # the change does not apply to this entry (no validation records)
    field = f"entries[{i}].{MUTATIONS[mutation][0]}"
    assert _named(found, "shipped_export.field_mismatch", field), (entries[i]["op"], found)


@pytest.mark.parametrize("mutation", ["family", "fingerprint", "device", "tokens", "speedup"])
def test_shipped_decode_entry_field_is_bound(tree: Path, mutation: str) -> None:
    entries = _shipped_subset(tree)["entries"]
    i = next(k for k, e in enumerate(entries) if e["op"] != "fused_moe")
    found = _shipped_case(tree, i, mutation)
    assert found is not None
    assert _named(found, "shipped_export.field_mismatch", f"entries[{i}].{MUTATIONS[mutation][0]}")


def test_shipped_validation_record_is_bound(tree: Path) -> None:
    entries = _shipped_subset(tree)["entries"]
    i = next(k for k, e in enumerate(entries) if e.get("validation"))
    for mutation in ("validation.tokens", "validation.routing_class"):
        found = _shipped_case(tree, i, mutation)
        assert found is not None
        field = f"entries[{i}].{MUTATIONS[mutation][0]}"
        assert _named(found, "shipped_export.field_mismatch", field), found


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"routing_class": "bursty"}, "routing class 'bursty' is unknown"),
        ({"dtype": "bfloat16"}, "not a canonical name"),
        ({"op": "matmul"}, "op 'matmul' is unknown"),
        ({"family": "E1-H2-I3-k1"}, "is not that of its dims"),
    ],
)
def test_import_refuses_an_entry_whose_key_the_dispatcher_cannot_build(
    tmp_path: Path, change: dict[str, Any], why: str
) -> None:
    doc = json.loads((EVIDENCE / SHIPPED).read_text())
    doc["entries"][0].update(change)
    path = tmp_path / SHIPPED
    path.write_text(json.dumps(doc))
    with pytest.raises(InvalidInputError, match=why):
        read_export(path)
