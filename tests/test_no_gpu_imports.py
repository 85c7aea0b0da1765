"""The core never imports torch, triton or flag_gems.

Stand-in packages named torch, triton and flag_gems are put first on the path;
importing any of them writes a marker file and fails.  ``import mxdb`` and the
CPU commands must leave no marker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mxdb.models import Fingerprint

GUARDED = ("torch", "triton", "flag_gems")


@pytest.fixture()
def guarded_env(tmp_path: Path) -> dict[str, str]:
    stubs = tmp_path / "stubs"
    markers = tmp_path / "markers"
    markers.mkdir()
    for name in GUARDED:
        pkg = stubs / name
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(
            "import pathlib, traceback\n"
            f"pathlib.Path({str(markers)!r}, {name!r}).write_text(''.join(traceback.format_stack()))\n"
            f"raise ImportError('the mxdb core imported {name}')\n"
        )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(stubs), env.get("PYTHONPATH", "")])
    env["MXDB_DB"] = f"sqlite:///{tmp_path / 'store.sqlite'}"
    env["MXDB_MARKERS"] = str(markers)
    # a CPU-only host, even when the suite runs on a GPU host (see test_gpu_host_detection)
    env["MXDB_GPU_HOST"] = "0"
    return env


def _markers(env: dict[str, str]) -> list[str]:
    return sorted(p.name for p in Path(env["MXDB_MARKERS"]).iterdir())


def test_import_mxdb_loads_no_gpu_package(guarded_env: dict[str, str]) -> None:
    code = (
        "import sys, json, mxdb, mxdb.cli, mxdb.dispatcher, mxdb.routing, mxdb.fingerprint, "
        "mxdb.audit, mxdb.interop.export, mxdb.store\n"
        f"print(json.dumps([m for m in {GUARDED!r} if m in sys.modules]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=guarded_env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []
    assert _markers(guarded_env) == []


def test_cpu_commands_load_no_gpu_package(guarded_env: dict[str, str], tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps([[0, 1], [2, 3], [1, 0], [3, 2]]))
    fp = tmp_path / "fp.json"
    fp.write_text(Fingerprint(vendor="nvidia", device_name="NVIDIA H200").model_dump_json())
    shape = [
        "--experts",
        "8",
        "--hidden",
        "4096",
        "--intermediate",
        "14336",
        "--topk",
        "2",
        "--tokens",
        "4",
        "--dtype",
        "bf16",
    ]
    vllm_dir = Path(__file__).resolve().parent.parent / "mxdb" / "data" / "vllm"
    bundle = tmp_path / "empty-bundle"
    bundle.mkdir()
    commands = [
        (["import", "vllm", str(vllm_dir)], 0),  # creates the store: reading commands never do
        (["dispatch", *shape, "--json"], 0),
        (
            ["dispatch", *shape, "--routing-trace", str(trace), "--fingerprint", str(fp), "--json"],
            0,
        ),
        (["trace", str(trace), "--experts", "8", "--json"], 0),
        (["fingerprint", "--json"], 0),
        (["import", "vllm", str(vllm_dir)], 0),
        (["export", "--format", "vllm", "--imported", "--out", str(tmp_path / "out-vllm")], 0),
        (["export", "--format", "mxdb", "--out", str(tmp_path / "export.json")], 0),
        (["import", "mxdb", str(tmp_path / "export.json")], 0),
        (["audit", str(bundle)], 1),
    ]
    for argv, expected in commands:
        out = subprocess.run(
            [sys.executable, "-m", "mxdb", *argv], env=guarded_env, capture_output=True, text=True
        )
        assert out.returncode == expected, (argv, out.stdout[-2000:], out.stderr[-2000:])
        assert _markers(guarded_env) == [], (argv, out.stderr)


def test_gpu_host_detection(guarded_env: dict[str, str]) -> None:
    """On a GPU host --offline imports nothing; without it the GPU layer is tried, lazily."""
    env = {**guarded_env, "MXDB_GPU_HOST": "1"}
    from mxdb.store import Store

    Store.open(env["MXDB_DB"]).close()  # dispatch only reads: the store must exist
    shape = ["-E", "8", "-H", "4096", "-I", "14336", "-k", "2", "-M", "4", "--json"]
    for argv in (["fingerprint", "--offline", "--json"], ["dispatch", *shape, "--offline"]):
        out = subprocess.run(
            [sys.executable, "-m", "mxdb", *argv], env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, (argv, out.stderr)
        assert _markers(env) == [], argv
    out = subprocess.run(
        [sys.executable, "-m", "mxdb", "fingerprint", "--json"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    # the stand-in torch refuses to import: the GPU-free fingerprint, and why
    assert doc["source"] == "offline" and "not readable" in doc["note"]
    assert "torch" in _markers(env)
