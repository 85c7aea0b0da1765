"""Environment fingerprints: collection without GPU imports, hashes, diffs, policies, files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import mxdb.cli  # noqa: F401  (registers every command)
from mxdb import __version__
from mxdb.cli.app import cli
from mxdb.errors import InvalidInputError, NotFoundError, UsageError
from mxdb.fingerprint import (
    FLAG_GEMS_5_0_2_KERNEL_SOURCE_HASH,
    POLICIES,
    collect,
    diff,
    fingerprint_document,
    kernel_source_hash,
    load_fingerprint,
    matches,
    mismatches,
    parse_fingerprint,
    recorded,
)
from mxdb.models import FINGERPRINT_COMPONENTS, Fingerprint

DATA = Path(__file__).parent / "data" / "fingerprints"

#: A newer value for each component, to upgrade one at a time.
UPGRADES = {
    "vendor": "other",
    "device_name": "NVIDIA H100 80GB HBM3",
    "arch": "sm_100",
    "sm_count": 144,
    "smem_per_block": 101376,
    "warp_size": 64,
    "driver": "590.10.01",
    "toolkit": "CUDA 13.1",
    "torch": "2.12.0+cu130",
    "triton": "3.7.0",
    "flag_gems": "5.0.3",
    "kernel_source_hash": "0123456789abcdef",
    "mxdb": "0.2.0",
}


def test_recorded_files_match_recorded_functions() -> None:
    for name, file in (("c500-m0", "c500_m0.json"), ("h200", "h200.json")):
        fp = load_fingerprint(DATA / file)
        assert fp == recorded(name)
        assert json.loads((DATA / file).read_text())["hash"] == fp.hash


def test_recorded_c500_facts() -> None:
    fp = recorded("c500-m0")
    assert fp.vendor == "metax"
    assert fp.smem_per_block == 65536 and fp.warp_size == 64
    assert fp.toolkit == "MXMACA 3.5.3.20"
    assert fp.torch == "2.8.0+metax3.5.3.9"
    assert fp.flag_gems == "5.0.2"
    assert set(fp.absent()) == {
        "arch",
        "sm_count",
        "driver",
        "triton",
        "kernel_source_hash",
        "mxdb",
    }


def test_recorded_h200_facts() -> None:
    fp = recorded("h200")
    assert (fp.device_name, fp.sm_count, fp.smem_per_block, fp.warp_size) == (
        "NVIDIA H200",
        132,
        232448,
        32,
    )
    assert (fp.torch, fp.triton, fp.driver, fp.toolkit, fp.flag_gems) == (
        "2.11.0+cu130",
        "3.6.0",
        "580.159.04",
        "CUDA 13.0",
        "5.0.2",
    )
    assert fp.kernel_source_hash == FLAG_GEMS_5_0_2_KERNEL_SOURCE_HASH
    assert not fp.absent()
    with pytest.raises(UsageError, match="recorded: c500-m0, h200"):
        recorded("mi300")


def test_hash_is_stable_and_order_free() -> None:
    a = Fingerprint(**recorded("h200").components())
    b = Fingerprint(**dict(reversed(list(recorded("h200").components().items()))))
    assert a.hash == b.hash == recorded("h200").hash
    # a pinned value: a change in the hash recipe would orphan every stored entry
    assert recorded("h200").hash == json.loads((DATA / "h200.json").read_text())["hash"]


@pytest.mark.parametrize("component", FINGERPRINT_COMPONENTS)
def test_each_component_upgrade_is_named_and_changes_the_hash(component: str) -> None:
    old = recorded("h200")
    new = old.model_copy(update={component: UPGRADES[component]})
    changes = diff(old, new)
    assert [c.component for c in changes] == [component]
    assert changes[0].old == getattr(old, component)
    assert changes[0].new == UPGRADES[component]
    assert new.hash != old.hash
    assert not matches(old, new, "strict")
    tolerated = component not in POLICIES["device"]
    assert matches(old, new, "device") is tolerated
    assert component in ("driver", "toolkit", "torch", "mxdb", "sm_count") or not tolerated


def test_diff_is_in_component_order_and_names_absent() -> None:
    c500, h200 = recorded("c500-m0"), recorded("h200")
    changes = diff(c500, h200)
    names = [c.component for c in changes]
    assert names == [n for n in FINGERPRINT_COMPONENTS if n in names]
    assert "flag_gems" not in names  # both 5.0.2
    triton = next(c for c in changes if c.component == "triton")
    assert triton.old is None and triton.describe() == "triton: absent -> 3.6.0"
    assert diff(h200, h200) == []
    assert [c.component for c in mismatches(c500, h200, "device")] == [
        n for n in POLICIES["device"] if n != "flag_gems"
    ]
    with pytest.raises(UsageError, match="known: strict, device"):
        matches(c500, h200, "loose")


def test_collect_without_gpu_fills_software_only() -> None:
    fp = collect()
    assert fp.mxdb == __version__
    for name in ("device_name", "arch", "sm_count", "smem_per_block", "warp_size", "driver"):
        assert getattr(fp, name) is None


def test_collect_takes_live_device_facts() -> None:
    live = {
        "vendor": "nvidia",
        "device_name": "NVIDIA H200",
        "arch": "sm_90",
        "sm_count": 132,
        "smem_per_block": 232448,
        "warp_size": 32,
        "driver": "580.159.04",
        "toolkit": "CUDA 13.0",
    }
    fp = collect(live)
    for k, v in live.items():
        assert getattr(fp, k) == v
    # the GPU layer's reading of the loaded modules wins over distribution metadata
    assert collect({"torch": "2.11.0+cu130", "triton": "3.6.0"}).torch == "2.11.0+cu130"
    with pytest.raises(UsageError, match="unknown live fingerprint components"):
        collect({"mxdb": "9.9"})
    with pytest.raises(UsageError, match="unknown live fingerprint components"):
        collect({"gpu_count": 2})
    with pytest.raises(UsageError, match="sm_count"):
        collect({"sm_count": "many"})


def _fake_site(
    tmp_path: Path, *, triton_dist: str = "triton", torch_version: str = "2.8.0"
) -> Path:
    """A site dir with distribution metadata and a flag_gems whose import would fail."""
    site = tmp_path / "site"
    pkg = site / "flag_gems"
    (pkg / "fused").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('flag_gems was imported')\n")
    (pkg / "fused" / "fused_moe.py").write_text("# kernel v1\n")
    (pkg / "fused" / "moe_sum.py").write_text("# sum\n")
    (pkg / "fused" / "other.py").write_text("# not part of the hash\n")
    for dist, version in (("flag_gems", "5.0.2"), (triton_dist, "3.1.0"), ("torch", torch_version)):
        info = site / f"{dist}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    return site


def _collect_in(site: Path) -> dict[str, object]:
    code = (
        "import json, sys\n"
        "from mxdb.fingerprint import collect, fingerprint_document\n"
        "doc = fingerprint_document(collect())\n"
        "gpu = ('torch', 'triton', 'flag_gems')\n"
        "doc['imported'] = sorted(m for m in gpu if m in sys.modules)\n"
        "print(json.dumps(doc))\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    result: dict[str, object] = json.loads(out.stdout)
    return result


def test_collect_reads_versions_and_kernel_hash_without_importing(tmp_path: Path) -> None:
    site = _fake_site(tmp_path)
    doc = _collect_in(site)
    assert doc["imported"] == []
    assert (doc["torch"], doc["triton"], doc["flag_gems"]) == ("2.8.0", "3.1.0", "5.0.2")
    assert doc["kernel_source_hash"] == kernel_source_hash(site / "flag_gems")
    assert doc["vendor"] is None


def test_collect_detects_metax_triton(tmp_path: Path) -> None:
    doc = _collect_in(
        _fake_site(tmp_path, triton_dist="mctriton", torch_version="2.8.0+metax3.5.3.9")
    )
    assert doc["triton"] == "mctriton 3.1.0"
    assert doc["vendor"] == "metax"


def test_kernel_source_hash_tracks_the_kernel_files(tmp_path: Path) -> None:
    site = _fake_site(tmp_path)
    root = site / "flag_gems"
    h1 = kernel_source_hash(root)
    assert h1 is not None and len(h1) == 16
    (root / "fused" / "other.py").write_text("# changed, but not a kernel file\n")
    assert kernel_source_hash(root) == h1
    (root / "fused" / "fused_moe.py").write_text("# kernel v2\n")
    h2 = kernel_source_hash(root)
    assert h2 != h1
    moved = tmp_path / "elsewhere"
    root.rename(moved)
    assert kernel_source_hash(moved) == h2  # independent of the install location
    assert kernel_source_hash(tmp_path / "nothing") is None


def test_load_fingerprint_errors(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="does not exist"):
        load_fingerprint(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(InvalidInputError, match="not valid JSON"):
        load_fingerprint(bad)
    bad.write_text(json.dumps(["nvidia"]))
    with pytest.raises(InvalidInputError, match="must be a JSON object"):
        load_fingerprint(bad)
    bad.write_text(json.dumps({"gpu": "H200"}))
    with pytest.raises(InvalidInputError, match="unknown fingerprint components"):
        load_fingerprint(bad)
    bad.write_text(json.dumps({"sm_count": "lots"}))
    with pytest.raises(InvalidInputError, match="sm_count"):
        load_fingerprint(bad)
    doc = fingerprint_document(recorded("h200"))
    doc["driver"] = "999.0"  # edited, hash kept
    bad.write_text(json.dumps(doc))
    with pytest.raises(InvalidInputError, match="does not match its components"):
        load_fingerprint(bad)
    assert parse_fingerprint({"fingerprint": recorded("c500-m0").components()}) == recorded(
        "c500-m0"
    )


def test_cli_fingerprint_json_round_trips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MXDB_GPU_HOST", "0")  # the GPU-free fingerprint, on any host
    runner = CliRunner()
    result = runner.invoke(cli, ["fingerprint", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    fp = doc["fingerprint"]
    assert fp["hash"] == collect().hash
    assert fp["mxdb"] == __version__
    saved = tmp_path / "fp.json"
    saved.write_text(json.dumps(fp))
    assert load_fingerprint(saved) == collect()
    same = runner.invoke(cli, ["fingerprint", "--diff", str(saved)])
    assert same.exit_code == 0 and "no component changed" in same.output


def test_cli_fingerprint_human_and_diff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MXDB_GPU_HOST", "0")  # the GPU-free fingerprint, on any host
    runner = CliRunner()
    result = runner.invoke(cli, ["fingerprint"])
    assert result.exit_code == 0
    assert "absent" in result.output and collect().hash in result.output
    changed = runner.invoke(cli, ["fingerprint", "--diff", str(DATA / "h200.json")])
    assert changed.exit_code == 1
    assert "changed device_name: NVIDIA H200 -> absent" in changed.output
    as_json = runner.invoke(cli, ["fingerprint", "--json", "--diff", str(DATA / "c500_m0.json")])
    assert as_json.exit_code == 1
    names = [c["component"] for c in json.loads(as_json.output)["changes"]]
    assert "smem_per_block" in names and "mxdb" in names
    missing = runner.invoke(cli, ["fingerprint", "--diff", "/nonexistent/fp.json"])
    assert missing.exit_code == 1 and "does not exist" in missing.output


def test_an_evidence_bundle_fingerprint_document_loads(tmp_path: Path) -> None:
    fp = recorded("h200")
    doc = {
        "schema": "mxdb.fingerprint",
        "schema_version": "1.0",
        "fingerprint": fp.components(),
        "hash": fp.hash,
    }
    path = tmp_path / "fingerprint.json"
    path.write_text(json.dumps(doc))
    assert load_fingerprint(path) == fp
    doc["hash"] = "0" * 16
    path.write_text(json.dumps(doc))
    with pytest.raises(InvalidInputError, match="does not match its components"):
        load_fingerprint(path)
