"""``mxdb tune`` leaves nothing behind: every backend it makes is closed (their compile pools
shut down in order), no process outlives it, and Python's resource tracker reports no leaked
semaphore."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from mxdb.tune.fake import FakeBackend
from mxdb.tune.runner import tune
from mxdb.tune.workload import parse_workload

TINY = {
    "name": "tiny",
    "models": [{"experts": 8, "hidden": 1024, "intermediate": 1024, "topk": 2}],
    "tokens": [4, 16],
    "dtypes": ["bf16"],
    "routings": [{"kind": "uniform"}],
    "search": {"max_candidates": 6, "halving_rounds": 1, "replay_reps": 3, "finalists": 2},
}


class ClosingFake(FakeBackend):
    """The fake backend, leaving a marker file when made and when closed."""

    def __init__(self, marker_dir: str, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.tag = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.dir = Path(marker_dir)
        (self.dir / f"made-{self.tag}").write_text("")

    def close(self) -> None:
        (self.dir / f"closed-{self.tag}").write_text("")


def _markers(d: Path, kind: str) -> set[str]:
    return {p.name.split("-", 1)[1] for p in d.glob(f"{kind}-*")}


def test_every_backend_the_tuner_makes_is_closed(tmp_path: Path) -> None:
    wl = parse_workload(TINY)
    for devices in (None, [0, 1]):
        d = tmp_path / f"markers-{bool(devices)}"
        d.mkdir()
        factory = functools.partial(ClosingFake, str(d))
        report = tune(
            wl,
            store_url=f"sqlite:///{d / 'db.sqlite'}",
            out_dir=d / "ev",
            devices=devices,
            backend_factory=factory,
            progress=False,
        )
        assert report.points_done == 2
        made = _markers(d, "made")
        assert len(made) == (3 if devices else 1)  # the coordinator's and one per worker
        assert _markers(d, "closed") == made


def _processes_with(tag: str) -> list[int]:
    """Live processes whose environment carries ``tag`` (children inherit it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if tag.encode() in env:
            found.append(int(entry.name))
    return found


def test_cli_tune_leaks_no_semaphore_and_no_process(tmp_path: Path) -> None:
    wl = tmp_path / "tiny.yaml"
    wl.write_text(yaml.safe_dump(TINY))
    tag = f"mxdb-leak-check-{uuid.uuid4().hex}"
    env = {**os.environ, "PYTHONWARNINGS": "always", "MXDB_LEAK_CHECK": tag}
    for extra in ([], ["--devices", "0,1"]):
        db = f"sqlite:///{tmp_path / f'db{len(extra)}.sqlite'}"
        out = subprocess.run(
            [sys.executable, "-m", "mxdb", "tune", str(wl), "--backend", "fake", "--db", db,
             "--out", str(tmp_path / "ev"), "--no-progress", *extra],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        assert "leaked" not in out.stderr, out.stderr[-2000:]
        assert "resource_tracker" not in out.stderr, out.stderr[-2000:]
        assert _processes_with(tag) == []


@pytest.mark.gpu
def test_gpu_tune_leaks_no_semaphore_and_no_process(tmp_path: Path) -> None:
    """The real compile pool (spawned workers importing torch, Triton and FlagGems)."""
    wl = tmp_path / "tiny.yaml"
    wl.write_text(yaml.safe_dump({**TINY, "tokens": [4]}))
    tag = f"mxdb-leak-check-{uuid.uuid4().hex}"
    env = {
        **os.environ,
        "PYTHONWARNINGS": "always",
        "MXDB_LEAK_CHECK": tag,
        "MXDB_COMPILE_WORKERS": "2",
    }
    out = subprocess.run(
        [sys.executable, "-m", "mxdb", "tune", str(wl), "--backend", "gpu",
         "--db", f"sqlite:///{tmp_path / 'db.sqlite'}", "--out", str(tmp_path / "ev"),
         "--no-progress"],
        env=env, capture_output=True, text=True, timeout=500,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "leaked" not in out.stderr, out.stderr[-3000:]
    assert _processes_with(tag) == []
