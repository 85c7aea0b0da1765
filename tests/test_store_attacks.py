"""Attacks on the store a bundle exports, and on imports: each is caught, none is dispatched.

The bundles are committed H200 tunes behind the shipped store (the peers workload and its
sparse class, run schema 1.2): the audit rebuilds every exported entry from the runs' raw
samples, so an entry that is made up, edited or stripped of its bundle is a finding, even with
every hash and the manifest recomputed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mxdb import Dispatcher, MoEShape
from mxdb.audit import audit_paths
from mxdb.cli.app import cli
from mxdb.errors import InvalidInputError
from mxdb.evidence.writer import write_manifest
from mxdb.interop.export import import_export
from mxdb.models import Fingerprint
from mxdb.store import Store

EVIDENCE = Path(__file__).resolve().parent.parent / "evidence"
BUNDLES = sorted(EVIDENCE.glob("h200-peers-*-20261201T06*"))
EXPORT = "store_export.json"


@pytest.fixture()
def bundles(tmp_path: Path) -> Path:
    # the first tune behind the shipped store: the peers workload's three routings and its
    # sparse class (the main job audits the shipped file against all of its bundles)
    assert len(BUNDLES) == 4, BUNDLES
    root = tmp_path / "ev"
    for b in BUNDLES:
        shutil.copytree(b, root / b.name)
    return root


def _load(path: Path) -> Any:
    return json.loads(path.read_text())


def _save_and_remanifest(bundle: Path, name: str, doc: Any) -> None:
    (bundle / name).write_text(json.dumps(doc, indent=2))
    m = _load(bundle / "manifest.json")
    write_manifest(bundle, bundle_id=m["bundle_id"], milestone=m["milestone"])


def _checks(root: Path) -> set[str]:
    return {f.check for f in audit_paths([root]).findings}


def _uniform(root: Path) -> Path:
    return next(root.glob("h200-peers-uniform-*"))


def _own_entry(bundle: Path, status: str) -> int:
    """An entry whose evidence run is in ``bundle`` itself."""
    export = _load(bundle / EXPORT)
    runs = {p.stem for p in (bundle / "runs").glob("*.json")}
    return next(
        i
        for i, e in enumerate(export["entries"])
        if e["status"] == status and e["evidence"] in runs
    )


def _with_own_entry(root: Path, status: str) -> tuple[Path, int]:
    """The first peers bundle holding an entry of ``status`` backed by its own runs, and it
    (at small M several routings fall in one class, so a key's record may live elsewhere)."""
    for b in sorted(root.glob("h200-peers-*")):
        try:
            return b, _own_entry(b, status)
        except StopIteration:
            continue
    raise AssertionError(f"no committed peers bundle has its own {status} entry")


def test_the_committed_bundles_audit_clean(bundles: Path) -> None:
    assert audit_paths([bundles]).findings == ()


def test_a_forged_verified_entry_is_caught(bundles: Path) -> None:
    b = _uniform(bundles)
    export = _load(b / EXPORT)
    forged = dict(export["entries"][_own_entry(b, "verified")])
    forged.update(tokens=3, speedup=1.5, evidence="made-up-run")
    forged["dims"] = {**forged["dims"], "tokens": 3}
    export["entries"].append(forged)
    _save_and_remanifest(b, EXPORT, export)
    assert "store_export.unbacked_entry" in _checks(bundles)


def test_an_inflated_speedup_is_caught(bundles: Path) -> None:
    b = _uniform(bundles)
    export = _load(b / EXPORT)
    i = _own_entry(b, "verified")
    export["entries"][i]["speedup"] *= 1.2
    _save_and_remanifest(b, EXPORT, export)
    findings = audit_paths([bundles]).findings
    assert any(
        f.check == "store_export.field_mismatch" and f.field == f"entries[{i}].speedup"
        for f in findings
    ), findings


def test_a_baseline_record_promoted_to_verified_is_caught(bundles: Path) -> None:
    b, i = _with_own_entry(bundles, "baseline")
    export = _load(b / EXPORT)
    export["entries"][i]["status"] = "verified"
    _save_and_remanifest(b, EXPORT, export)
    # bound to the baseline decision of its evidence run: the status is named
    found = {(f.check, f.field) for f in audit_paths([bundles]).findings}
    assert ("store_export.field_mismatch", f"entries[{i}].status") in found


def test_a_single_config_record_is_remade_from_its_runs(bundles: Path) -> None:
    """The tuner's single-config record (what vLLM's table gets where the winner is fused_act)
    is audited like a decision: an inflated speedup, or one moved to another config, is caught."""
    b, i = _with_own_entry(bundles, "imported")
    export = _load(b / EXPORT)
    assert export["entries"][i]["source"] == "tune-single"
    export["entries"][i]["speedup"] *= 1.05
    _save_and_remanifest(b, EXPORT, export)
    assert "store_export.field_mismatch" in _checks(bundles)
    export["entries"][i]["speedup"] /= 1.05
    other = next(
        e for e in export["entries"] if e["config_hash"] != export["entries"][i]["config_hash"]
    )
    export["entries"][i]["config"] = other["config"]
    export["entries"][i]["config_hash"] = other["config_hash"]
    _save_and_remanifest(b, EXPORT, export)
    assert "store_export.unbacked_entry" in _checks(bundles)


def test_an_imported_entry_of_another_source_is_refused(bundles: Path) -> None:
    b, i = _with_own_entry(bundles, "imported")
    export = _load(b / EXPORT)
    export["entries"][i]["source"] = "vllm"
    _save_and_remanifest(b, EXPORT, export)
    assert "store_export.status_invalid" in _checks(bundles)


def test_a_deleted_store_export_is_caught(bundles: Path) -> None:
    b = _uniform(bundles)
    (b / EXPORT).unlink()
    m = _load(b / "manifest.json")
    write_manifest(b, bundle_id=m["bundle_id"], milestone=m["milestone"])
    assert "store_export.missing" in _checks(bundles)


def test_a_deleted_fingerprint_is_caught(bundles: Path) -> None:
    b = _uniform(bundles)
    (b / "fingerprint.json").unlink()
    m = _load(b / "manifest.json")
    write_manifest(b, bundle_id=m["bundle_id"], milestone=m["milestone"])
    assert "fingerprint.missing" in _checks(bundles)


def _shipped(bundles: Path) -> dict[str, Any]:
    """A shipped export made of every bundle's entries (what the main job imports)."""
    docs = [_load(b / EXPORT) for b in sorted(bundles.glob("h200-peers-*"))]
    doc = docs[0]
    seen = set()
    entries = []
    for d in docs:
        for e in d["entries"]:
            key = json.dumps(e, sort_keys=True)
            if key not in seen:
                seen.add(key)
                entries.append(e)
    doc["entries"] = entries
    return doc


def test_a_shipped_export_is_audited_against_its_bundles(bundles: Path) -> None:
    doc = _shipped(bundles)
    (bundles / "store-export.json").write_text(json.dumps(doc))
    assert audit_paths([bundles]).findings == ()
    forged = dict(doc["entries"][0])
    forged.update(tokens=3, config_hash="0" * 16)
    doc["entries"].append(forged)
    edited = json.loads(json.dumps(doc))
    edited["entries"][1]["speedup"] = 9.0
    (bundles / "store-export.json").write_text(json.dumps(doc))
    assert "shipped_export.unbacked_entry" in _checks(bundles)
    (bundles / "store-export.json").write_text(json.dumps(edited))
    assert _checks(bundles) & {"shipped_export.field_mismatch", "shipped_export.unbacked_entry"}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda e: e["config"]["gemm1"].update(block_m=3), "not a valid fused_moe config"),
        (lambda e: e.update(config_hash="0" * 16), "is not the hash of its config"),
        (lambda e: e.update(family="E9-H1-I1-k1"), "is not that of its dims"),
    ],
)
def test_import_rejects_a_bad_entry_by_name(tmp_path: Path, edit: Any, message: str) -> None:
    doc = _load(EVIDENCE / "store-export.json")
    edit(doc["entries"][5])
    path = tmp_path / "export.json"
    path.write_text(json.dumps(doc))
    db = f"sqlite:///{tmp_path / 's.sqlite'}"
    res = CliRunner().invoke(cli, ["import", "mxdb", str(path), "--db", db])
    assert res.exit_code == 2 and "entries[5]" in res.output and message in res.output
    with Store.open(db) as store:
        assert sum(store.count_entries().values()) == 0  # nothing half-imported


ENTRY_EDITS = st.fixed_dictionaries(
    {},
    optional={
        "tokens": st.integers(-3, 10**6),
        "routing_class": st.sampled_from(["uniform", "skewed", "hot", "sparse", "odd", ""]),
        "status": st.sampled_from(["verified", "baseline", "imported", "stale", "bogus"]),
        "speedup": st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
        "config_hash": st.text("0123456789abcdef", min_size=0, max_size=17),
        "block_m": st.integers(-2, 1025),
        "align_block": st.integers(-2, 1025),
        "num_warps": st.integers(-1, 64),
        "impl": st.one_of(
            st.sampled_from(["flaggems", "fused_act", "", "FUSED_ACT", "cutlass"]), st.integers()
        ),
    },
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(edits=st.lists(ENTRY_EDITS, min_size=1, max_size=3), tokens=st.integers(1, 5000))
def test_fuzzed_imports_never_lead_to_a_dispatch_that_raises(
    tmp_path_factory: pytest.TempPathFactory, edits: list[dict[str, Any]], tokens: int
) -> None:
    tmp = tmp_path_factory.mktemp("fuzz")
    doc = _load(EVIDENCE / "store-export.json")
    doc["entries"] = [e for e in doc["entries"] if e["op"] == "fused_moe"][:6]
    for i, ed in enumerate(edits):
        e = doc["entries"][i]
        for k in ("tokens", "routing_class", "status", "speedup", "config_hash"):
            if k in ed:
                e[k] = ed[k]
        for k in ("block_m", "num_warps"):
            if k in ed:
                e["config"]["gemm1"][k] = ed[k]
        if "align_block" in ed:
            e["config"]["align_block"] = ed["align_block"]
        if "impl" in ed:
            e["config"]["impl"] = ed["impl"]
    path = tmp / "export.json"
    path.write_text(json.dumps(doc))
    store = Store.open(f"sqlite:///{tmp / 's.sqlite'}")
    try:
        try:
            import_export(store, path)
        except InvalidInputError:
            pass
        fp = Fingerprint.model_validate(next(iter(doc["fingerprints"].values())))
        disp = Dispatcher(store, fp)
        for e in doc["entries"]:
            shape = MoEShape(8, 4096, 14336, 2, tokens, "bf16")
            if e["family"].startswith("E128"):
                shape = MoEShape(128, 2048, 768, 8, tokens, "bf16")
            for routing in ("uniform", "skewed", "hot", "sparse"):
                d = disp.dispatch(shape, routing)
                assert d.level in ("exact", "neighbour", "incumbent", "fallback")
    finally:
        store.close()
