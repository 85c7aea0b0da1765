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


def _bench() -> object:
    spec = importlib.util.spec_from_file_location("bench_tuning_reuse", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_reuse_sweeps_end_to_end_on_fake(tmp_path: Path) -> None:
    """Sweep run -> bundle -> reuse run (search + one final timing) -> bundle -> clean audit."""
    from mxdb.audit.checks import audit_bundle

    mod: object = _bench()
    main = mod.main  # type: ignore[attr-defined]
    assert main(["--backend", "fake", "--sweep-run", "--out", str(tmp_path / "src")]) == 0
    src = tmp_path / "srcb"
    assert (
        main(["--bundle-from", str(tmp_path / "src" / "bench_tuning_gpu.json"), "--out", str(src)])
        == 0
    )
    assert audit_bundle(src).findings == ()
    assert (
        main(["--backend", "fake", "--reuse-sweeps", str(src), "--out", str(tmp_path / "tc")]) == 0
    )
    raw = tmp_path / "tc" / "bench_tuning_gpu.json"
    # no sweep is timed again: only the search and one final timing per point
    kinds = {t["kind"] for p in json.loads(raw.read_text())["points"] for t in p["tasks"].values()}
    assert kinds == {"mxdb", "final"}
    out = tmp_path / "tcb"
    args = ["--bundle-from", str(raw), "--sweeps-from", str(src), "--out", str(out)]
    assert main([*args, "--milestone", "h200-tuning-cost-2"]) == 0
    assert audit_bundle(out).findings == ()
    doc = json.loads((out / "tuning_cost.json").read_text())
    assert doc["schema_version"] == "1.1"
    for p in doc["points"]:
        assert (out / p["exhaustive"]["sweeps"][0]).read_bytes() == (
            src / p["exhaustive"]["sweeps"][0]
        ).read_bytes()
        assert p["answer"] in ("winner", "baseline")
        assert 0.05 <= p["gpu_time_fraction"] <= 0.10
        assert p["quality_ratio"] <= 1.01
    # mxdb's answer decides the headline ratio: flip it and the audit objects
    doc["points"][0]["answer"] = "baseline" if doc["points"][0]["answer"] == "winner" else "winner"
    (out / "tuning_cost.json").write_text(json.dumps(doc))
    from mxdb.evidence.writer import write_manifest

    m = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").unlink()
    write_manifest(out, bundle_id=m["bundle_id"], milestone=m["milestone"])
    assert "tuning_cost.mismatch" in {f.check for f in audit_bundle(out).findings}
