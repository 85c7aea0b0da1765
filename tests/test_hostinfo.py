"""One "this host": the live fingerprint on a GPU host, detected without importing torch."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import mxdb
from mxdb import hostinfo
from mxdb.cli.app import cli
from mxdb.fingerprint import H200, collect, fingerprint_document
from mxdb.models import Fingerprint

LIVE = {k: v for k, v in H200.items() if k != "mxdb"}


@pytest.fixture()
def gpu_host(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A detected GPU host whose GPU layer reads the recorded H200's facts."""
    monkeypatch.delenv("MXDB_FINGERPRINT", raising=False)
    monkeypatch.setenv("MXDB_GPU_HOST", "1")
    calls: dict[str, Any] = {"n": 0}
    live = types.ModuleType("mxdb.kernels.live")

    def components(device_index: int = 0) -> dict[str, Any]:
        calls["n"] += 1
        return dict(LIVE)

    live.live_fingerprint_components = components  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mxdb.kernels.live", live)
    return calls


def test_detection_without_imports(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MXDB_GPU_HOST", raising=False)
    monkeypatch.setattr(hostinfo, "DEVICE_FILES", (str(tmp_path / "nvidiactl"),))
    monkeypatch.setattr(hostinfo, "DEVICE_GLOBS", (str(tmp_path / "nvidia[0-9]*"),))
    monkeypatch.setattr(hostinfo, "SMI_TOOLS", ("no-such-smi-tool",))
    assert hostinfo.gpu_host_evidence() is None
    (tmp_path / "nvidia0").write_text("")
    assert hostinfo.gpu_host_evidence() == str(tmp_path / "nvidia0")
    (tmp_path / "nvidiactl").write_text("")
    assert hostinfo.gpu_host_evidence() == str(tmp_path / "nvidiactl")
    monkeypatch.setenv("MXDB_GPU_HOST", "0")
    assert hostinfo.gpu_host_evidence() is None


def test_live_on_a_gpu_host_is_the_tuners_hash(gpu_host: dict[str, Any]) -> None:
    host = hostinfo.host_fingerprint()
    # GpuBackend.fingerprint(): the live components plus mxdb's version
    tuner = Fingerprint(**LIVE, mxdb=mxdb.__version__)
    assert host.source == "live" and host.fingerprint.hash == tuner.hash
    offline = hostinfo.host_fingerprint(offline=True)
    assert offline.source == "offline" and offline.fingerprint == collect()
    assert gpu_host["n"] == 1


def test_unreadable_gpu_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MXDB_FINGERPRINT", raising=False)
    monkeypatch.setenv("MXDB_GPU_HOST", "1")
    live = types.ModuleType("mxdb.kernels.live")

    def broken(device_index: int = 0) -> dict[str, Any]:
        raise RuntimeError("Found no NVIDIA driver on your system")

    live.live_fingerprint_components = broken  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mxdb.kernels.live", live)
    host = hostinfo.host_fingerprint()
    assert host.source == "offline" and "no NVIDIA driver" in host.note


def test_cli_fingerprint_and_dispatch_use_the_live_one(
    gpu_host: dict[str, Any], tmp_path: Path
) -> None:
    runner = CliRunner()
    tuner = Fingerprint(**LIVE, mxdb=mxdb.__version__)
    doc = json.loads(runner.invoke(cli, ["fingerprint", "--json"]).output)
    assert doc["fingerprint"]["hash"] == tuner.hash and doc["source"] == "live"
    doc = json.loads(runner.invoke(cli, ["fingerprint", "--offline", "--json"]).output)
    assert doc["fingerprint"]["hash"] == collect().hash and doc["source"] == "offline"
    text = runner.invoke(cli, ["fingerprint"]).output
    assert "source" in text and "live" in text
    # a store entry recorded under the tuner's fingerprint answers `mxdb dispatch` here
    from mxdb import KernelConfig, MoEShape
    from mxdb.configs import GemmConfig
    from mxdb.models import Entry
    from mxdb.store import Store

    url = f"sqlite:///{tmp_path / 's.sqlite'}"
    shape = MoEShape(8, 4096, 14336, 2, 4, "bf16")
    cfg = KernelConfig.uniform(GemmConfig(block_m=16, block_n=64, block_k=64))
    with Store.open(url) as s:
        s.put_fingerprint(tuner)
        entry = Entry(
            dtype="bf16", family=shape.family, dims=shape.dims(), tokens=4,
            config=cfg.model_dump(), config_hash=cfg.hash, fingerprint_hash=tuner.hash,
            status="verified", source="tune", speedup=1.2, noise_band=0.01,
        )  # fmt: skip
        [eid] = s.add_entries([entry])
    argv = ["dispatch", "-E", "8", "-H", "4096", "-I", "14336", "-k", "2", "-M", "4"]
    res = json.loads(runner.invoke(cli, [*argv, "--db", url, "--json"]).output)
    assert res["entry_id"] == eid and res["fingerprint_source"] == "live"
    res = json.loads(runner.invoke(cli, [*argv, "--db", url, "--json", "--offline"]).output)
    assert res["entry_id"] is None and res["reason"] == "fingerprint_mismatch"
    # a recorded fingerprint still overrides
    fp_file = tmp_path / "fp.json"
    fp_file.write_text(json.dumps(fingerprint_document(tuner)))
    res = json.loads(
        runner.invoke(cli, [*argv, "--db", url, "--json", "--fingerprint", str(fp_file)]).output
    )
    assert res["entry_id"] == eid and res["fingerprint_source"] == "file"
