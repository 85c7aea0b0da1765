"""The evidence writer, statistics and synthetic bundles (GPU-free)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mxdb.configs import GemmConfig, KernelConfig
from mxdb.errors import EvidenceError, TraceError
from mxdb.evidence import BundleWriter, build_summary, make_timing, stats
from mxdb.evidence.files import manifest_digest, scan_tree, sha256_hex
from mxdb.evidence.synthetic import H200, synthetic_bundle
from mxdb.evidence.thresholds import THRESHOLDS, passes
from mxdb.evidence.writer import write_manifest
from mxdb.shapes import MoEShape

SAMPLES = st.lists(
    st.floats(min_value=1e-3, max_value=1e6, allow_nan=False, allow_infinity=False),
    min_size=1,
    max_size=40,
)


@given(SAMPLES)
def test_median_and_p90_match_numpy_bit_for_bit(samples: list[float]) -> None:
    assert stats.median(samples) == float(np.median(samples))
    assert stats.p90(samples) == float(np.percentile(samples, 90))


@given(st.lists(st.floats(min_value=0.5, max_value=2.0), min_size=1, max_size=20))
def test_geomean_matches_definition(values: list[float]) -> None:
    g = stats.geomean(values)
    assert g is not None
    assert math.isclose(g, float(np.exp(np.mean(np.log(values)))), rel_tol=1e-12)
    assert stats.geomean([]) is None


def test_noise_band_is_symmetric_and_zero_for_identical_medians() -> None:
    assert stats.pair_noise(10.0, 10.5) == stats.pair_noise(10.5, 10.0) == pytest.approx(0.05)
    assert stats.pair_noise(3.0, 3.0) == 0.0


def test_thresholds_accept_the_c500_m0_errors() -> None:
    assert passes("fp16", 0.0009765625, 2e-4)
    assert passes("bf16", 0.0078125, 2e-3)
    assert not passes("bf16", 0.1, 2e-3)
    assert not passes("fp16", float("nan"), 0.0)
    assert not passes("fp16", None, None)
    assert set(THRESHOLDS) == {"fp16", "bf16", "fp32"}


def _writer(tmp_path: Path) -> BundleWriter:
    return BundleWriter(tmp_path / "b", milestone="m1", fingerprint=H200)


def test_writer_refuses_inconsistent_runs(tmp_path: Path) -> None:
    w = _writer(tmp_path)
    shape = MoEShape(8, 4096, 14336, 2, 4, "bf16")
    cfg = KernelConfig.uniform(GemmConfig(block_m=16, block_n=64, block_k=64))
    with pytest.raises(EvidenceError, match="finite positive"):
        w.record(
            run_id="r1",
            shape=shape,
            routing_class="uniform",
            config=cfg,
            role="candidate",
            status="ok",
            samples_us=[1.0, float("nan")],
            max_abs_err=1e-3,
            rel_err=1e-3,
        )
    with pytest.raises(EvidenceError, match="pass correctness"):
        w.record(
            run_id="r2",
            shape=shape,
            routing_class="uniform",
            config=cfg,
            role="candidate",
            status="ok",
            samples_us=[1.0, 2.0],
            max_abs_err=0.5,
            rel_err=0.3,
        )
    with pytest.raises(EvidenceError, match="add_trace first"):
        w.record(
            run_id="r3",
            shape=shape,
            routing_class="uniform",
            config=cfg,
            role="candidate",
            status="oor",
            trace_hash="0" * 16,
        )
    with pytest.raises(EvidenceError, match="pair_id"):
        w.record(
            run_id="r4",
            shape=shape,
            routing_class="uniform",
            config=cfg,
            role="control",
            status="ok",
            samples_us=[1.0],
            max_abs_err=1e-3,
            rel_err=1e-3,
        )
    w.record(
        run_id="r5",
        shape=shape,
        routing_class="uniform",
        config=cfg,
        role="candidate",
        status="compile_error",
        error="boom",
    )
    with pytest.raises(EvidenceError, match="already in this bundle"):
        w.record(
            run_id="r5",
            shape=shape,
            routing_class="uniform",
            config=cfg,
            role="candidate",
            status="compile_error",
        )
    with pytest.raises(TraceError):
        w.add_trace([[0, 9]], experts=8, generator={"kind": "uniform"})
    # a record whose figures are not its samples' is refused
    t = make_timing([1.0, 2.0, 3.0])
    bad = t.model_copy(update={"median_us": 2.5})
    run = w.record(
        run_id="r6",
        shape=shape,
        routing_class="uniform",
        config=cfg,
        role="baseline",
        status="ok",
        samples_us=[1.0, 2.0, 3.0],
        max_abs_err=1e-3,
        rel_err=1e-3,
    )
    with pytest.raises(EvidenceError, match="timing figures"):
        w.add_run(run.model_copy(update={"run_id": "r7", "timing": bad}))


def test_writer_refuses_a_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("x")
    with pytest.raises(EvidenceError, match="not an empty directory"):
        _writer(tmp_path)


def test_finished_bundle_layout_and_summary(tmp_path: Path) -> None:
    root = synthetic_bundle(tmp_path / "b", groups=3, runs_per_group=8, seed=3)
    manifest = json.loads((root / "manifest.json").read_text())
    files, links, special = scan_tree(root)
    assert not links and not special
    assert set(manifest["files"]) == set(files) - {"manifest.json"}
    assert manifest["digest"] == manifest_digest(manifest["files"])
    for rel, h in manifest["files"].items():
        assert sha256_hex((root / rel).read_bytes()) == h
    summary = json.loads((root / "summary.json").read_text())
    assert summary == build_summary(root, bandwidth_bytes_per_s=4.27e12)
    assert summary["counts"]["runs"] == 24 and summary["counts"]["control_pairs"] == 3
    for g in summary["groups"]:
        assert g["best_run"] is None or "-c" in g["best_run"]  # never a control run
        if g["speedup"] is not None:
            assert g["speedup"] == pytest.approx(g["baseline_median_us"] / g["best_median_us"])


def test_writer_cannot_add_after_finish(tmp_path: Path) -> None:
    w = _writer(tmp_path)
    w.finish()
    with pytest.raises(EvidenceError, match="finished"):
        w.add_trace([[0, 1]], experts=8, generator={"kind": "uniform"})


names = st.text(alphabet="abcdefghij0123456789_-", min_size=1, max_size=8)


@settings(max_examples=25, deadline=None)
@given(
    st.dictionaries(
        st.tuples(names, names) | st.tuples(names), st.binary(max_size=64), min_size=1, max_size=8
    )
)
def test_manifest_round_trip_over_random_trees(
    tmp_path_factory: pytest.TempPathFactory, tree: dict[tuple[str, ...], bytes]
) -> None:
    root = tmp_path_factory.mktemp("tree")
    written: dict[str, bytes] = {}
    for parts, data in tree.items():
        rel = "/".join(parts)
        # skip paths that collide with a directory or file already made
        if any(rel.startswith(w + "/") or w.startswith(rel + "/") for w in written):
            continue
        p = root.joinpath(*parts)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        written[rel] = data
    m = write_manifest(root, bundle_id="t", milestone="t")
    assert m.files == {rel: sha256_hex(d) for rel, d in written.items()}
    loaded = json.loads((root / "manifest.json").read_text())
    assert loaded["files"] == m.files and loaded["digest"] == manifest_digest(m.files)


def test_publish_bundle_replaces_a_bundle_only_once_it_is_complete(tmp_path: Path) -> None:
    from mxdb.audit import AuditOptions, audit_paths
    from mxdb.evidence.writer import publish_bundle

    fp = H200
    bundle = tmp_path / "b"
    publish_bundle(bundle, fingerprint=fp, files={"report/a.md": "one\n"}, milestone="m")
    assert (bundle / "report" / "a.md").read_text() == "one\n"
    assert json.loads((bundle / "fingerprint.json").read_text())["hash"] == fp.hash
    res = audit_paths([bundle], AuditOptions())
    assert not res.findings, res.findings
    # a document that cannot be written: the old bundle stays as it was, whole
    with pytest.raises(ValueError):
        publish_bundle(bundle, fingerprint=fp, files={"x.json": {"v": math.nan}}, milestone="m")
    assert (bundle / "report" / "a.md").read_text() == "one\n" and (
        bundle / "manifest.json"
    ).exists()
    publish_bundle(bundle, fingerprint=fp, files={"report/a.md": "two\n"}, milestone="m")
    assert (bundle / "report" / "a.md").read_text() == "two\n"
    assert not (tmp_path / "b.new").exists()
