"""The tuning-cost benchmark's dry run on the fake backend."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_tuning.py"


def test_bench_tuning_fake_meets_target(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_tuning", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--backend", "fake", "--out", str(tmp_path), "--points", "2"]) == 0
    doc = json.loads((tmp_path / "bench_tuning.json").read_text())
    assert len(doc["points"]) == 2
    for p in doc["points"]:
        assert p["exhaustive"]["configs_timed"] > 3000
        assert p["quality_ratio"] <= 1.01
        assert p["gpu_time_fraction"] <= 0.10
