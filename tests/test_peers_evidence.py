"""Peers evidence (``peers.json``): publish from raw output, audit, and findings on tampering."""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
from bundle_edits import audit_codes, edit_claim

from mxdb.audit import audit_paths
from mxdb.evidence.peers import TARGETS, judge
from mxdb.evidence.writer import write_manifest
from mxdb.fingerprint import H200

REPO = Path(__file__).resolve().parent.parent
COMMITTED = REPO / "evidence" / "h200-peers"

FP = dict(H200)  # the recorded H200 host (mxdb.fingerprint)


def _gemm(bm: int, bn: int, bk: int, g: int, st: int) -> dict[str, int]:
    return {
        "block_m": bm,
        "block_n": bn,
        "block_k": bk,
        "group_m": g,
        "num_warps": 4,
        "num_stages": st,
    }


def _cfg(g1: dict[str, int], g2: dict[str, int]) -> dict[str, Any]:
    return {"gemm1": g1, "gemm2": g2, "align_block": 16}


CFG_A = _cfg(_gemm(16, 128, 128, 1, 3), _gemm(16, 128, 128, 1, 3))
CFG_B = _cfg(_gemm(16, 128, 128, 16, 5), _gemm(16, 128, 128, 16, 5))
CFG_C = _cfg(_gemm(16, 128, 128, 16, 5), _gemm(16, 32, 256, 32, 4))
CFG_D = _cfg(_gemm(16, 64, 128, 16, 4), _gemm(16, 32, 256, 32, 4))


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "benchmarks" / name)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _samples(rng: random.Random, center: float, n: int = 7) -> list[float]:
    return [center * (1 + rng.uniform(-0.003, 0.003)) for _ in range(n)]


#: (tokens, routing, ids, configs by label, centers by label, dispatch reasons)
POINTS: tuple[
    tuple[int, str, list[list[int]], dict[str, Any], dict[str, float], dict[str, str]], ...
] = (
    (
        1,
        "uniform",
        [[0, 1]],
        {"a": CFG_A, "b": CFG_B, "c": CFG_C},
        {"a": 200.0, "b": 185.0, "c": 180.0, "ctl1": 180.0, "ctl2": 180.2},
        {"c": "exact_match", "d": "exact_match"},
    ),
    (
        # the routing-oblivious choice wins here: a missed target; expert 0 takes half the slots
        4,
        "zipf",
        [[0, 1], [0, 2], [0, 3], [0, 4]],
        {"a": CFG_A, "b": CFG_B, "c": CFG_C, "d": CFG_D},
        {"a": 600.0, "b": 560.0, "c": 540.0, "d": 525.0, "ctl1": 540.0, "ctl2": 540.5},
        {"c": "neighbour_tokens", "d": "exact_match"},
    ),
    (
        # no entry answered: (c) is FlagGems' own config
        4,
        "uniform",
        [[0, 1], [2, 3], [4, 5], [6, 7]],
        {"a": CFG_A, "b": CFG_B, "c": CFG_A},
        {"a": 700.0, "b": 690.0, "c": 700.5, "ctl1": 700.0, "ctl2": 700.3},
        {"c": "tokens_out_of_range", "d": "tokens_out_of_range"},
    ),
)


def _raw() -> dict[str, Any]:
    """A small peers.py raw output: three points, one where routing changes mxdb's choice."""
    rng = random.Random(7)
    points = []
    for tokens, routing, ids, cfgs, centers, reasons in POINTS:
        points.append(
            {
                "family": "mixtral-8x7b",
                "tokens": tokens,
                "routing": routing,
                "routing_params": {"s": 1.2} if routing == "zipf" else {},
                "seed": tokens,
                "routing_class": "hot" if routing == "zipf" else routing,
                "ids": ids,
                "configs": cfgs,
                "reasons": reasons,
                "correctness": {n: [0.01, 0.004, True] for n in centers},
                "graph_us": {n: _samples(rng, c) for n, c in centers.items()},
                "eager_us": {
                    "a": _samples(rng, 2.2 * centers["a"]),
                    "c": _samples(rng, 1.05 * centers["c"]),
                },
                "reps": 7,
                "calls_per_sample": 4,
            }
        )
    return {
        "fingerprint": FP,
        "bandwidth_bytes_per_s": 4.2e12,
        "points": points,
        "errors": [],
        "dispatch_cost": {"mixtral-8x7b": {"mxdb_dispatch_hit_us": 0.2, "flaggems_lookup_us": 17}},
    }


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("peers")
    raw = root / "raw.json"
    raw.write_text(json.dumps(_raw()))
    bundle = root / "h200-peers"
    _load("peers.py").publish(raw, bundle)
    return bundle


@pytest.fixture
def bundle(published: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "h200-peers"
    shutil.copytree(published, dst)
    return dst


def test_published_bundle_passes_and_holds_every_figure(published: Path) -> None:
    assert audit_codes(published) == set()
    doc = json.loads((published / "peers.json").read_text())
    assert doc["schema"] == "mxdb.peers" and doc["schema_version"] == "1.0"
    assert [p["runs"]["d"] for p in doc["points"]] == [None, "mixtral-m4-zipf-d", None]
    assert doc["figures"]["points_routing_changes_dispatch"] == 1
    assert doc["figures"]["n_points"] == 3
    assert {t["name"] for t in doc["targets"]} == {t.name for t in TARGETS}
    for t in doc["targets"]:
        assert t["passed"] is judge(t["comparison"], t["measured"], t["threshold"])
    # (c) at ~180 us against (a) at ~200 us: the ratio is the medians' ratio
    p0 = doc["points"][0]
    assert p0["speedup_c_over_a"] == p0["median_us"]["a"] / p0["median_us"]["c"]
    assert "peers.json" in json.loads((published / "manifest.json").read_text())["files"]


def test_single_instance_layouts_leave_a_read_bandwidth_out(
    published: Path, tmp_path: Path
) -> None:
    """A raw output with a streaming-read bandwidth (every run measures one now) publishes a
    single-instance document as before, byte for byte: only schema 1.4 carries it."""
    raw = _raw()
    raw["read_bandwidth_bytes_per_s"] = 4.35e12
    path = tmp_path / "raw.json"
    path.write_text(json.dumps(raw))
    bundle = tmp_path / published.name
    _load("peers.py").publish(path, bundle)
    for name in ("peers.json", "report/peers.md"):
        assert (bundle / name).read_bytes() == (published / name).read_bytes(), name
    doc = json.loads((bundle / "peers.json").read_text())
    assert doc["schema_version"] == "1.0" and "read_bandwidth_bytes_per_s" not in doc
    assert "decode_geomean_floor_fraction_c_read" not in doc["figures"]
    assert audit_codes(bundle) == set()


def test_tampered_sample_is_found(bundle: Path) -> None:
    def bump(doc: dict[str, Any]) -> None:
        doc["timing"]["samples_us"] = [x * 1.5 for x in doc["timing"]["samples_us"]]
        doc["timing"]["median_us"] *= 1.5
        doc["timing"]["p90_us"] *= 1.5

    edit_claim(bundle, "runs/mixtral-m1-uniform-b.json", bump)
    checks = audit_codes(bundle)
    assert {"peers.median_mismatch", "peers.ratio_mismatch", "peers.geomean_mismatch"} <= checks


def test_tampered_ratio_is_found(bundle: Path) -> None:
    def inflate(doc: dict[str, Any]) -> None:
        doc["points"][1]["speedup_c_over_b"] *= 1.01

    edit_claim(bundle, "peers.json", inflate)
    assert audit_codes(bundle) == {"peers.ratio_mismatch"}


def test_tampered_eager_ratio_and_geomean_are_found(bundle: Path) -> None:
    def inflate(doc: dict[str, Any]) -> None:
        doc["points"][0]["eager_speedup_layer_over_fused_experts_impl"] = 3.0
        doc["figures"]["decode_geomean_eager_over_graph"] = 1.0

    edit_claim(bundle, "peers.json", inflate)
    assert audit_codes(bundle) == {"peers.ratio_mismatch", "peers.geomean_mismatch"}


def test_flipped_flag_and_count_are_found(bundle: Path) -> None:
    def flip(doc: dict[str, Any]) -> None:
        doc["points"][1]["c_differs_from_d"] = False
        doc["figures"]["points_c_slower_than_b"] += 1

    edit_claim(bundle, "peers.json", flip)
    assert audit_codes(bundle) == {"peers.flag_mismatch", "peers.count_mismatch"}


def test_pass_claimed_for_missed_target_is_found(bundle: Path) -> None:
    doc = json.loads((bundle / "peers.json").read_text())
    missed = [i for i, t in enumerate(doc["targets"]) if not t["passed"]]
    assert missed, "the synthetic data misses at least one target (routing_aware_pays)"

    def claim_pass(d: dict[str, Any]) -> None:
        d["targets"][missed[0]]["passed"] = True

    edit_claim(bundle, "peers.json", claim_pass)
    res = audit_paths([bundle])
    assert {f.check for f in res.findings} == {"peers.target_verdict_mismatch"}
    assert res.findings[0].field == f"targets[{missed[0]}].passed"


def test_moved_threshold_and_measured_are_found(bundle: Path) -> None:
    def move(d: dict[str, Any]) -> None:
        d["targets"][0]["threshold"] = 0.5
        d["targets"][1]["measured"] = 9.0
        del d["targets"][2]

    edit_claim(bundle, "peers.json", move)
    assert audit_codes(bundle) == {
        "peers.target_threshold_mismatch",
        "peers.target_measured_mismatch",
        "peers.target_missing",
    }


def test_missing_run_and_wrong_role_are_found(bundle: Path) -> None:
    (bundle / "runs" / "mixtral-m4-zipf-d.json").unlink()
    m = json.loads((bundle / "manifest.json").read_text())
    write_manifest(bundle, bundle_id=m["bundle_id"], milestone=m["milestone"])
    assert "peers.run_missing" in audit_codes(bundle)

    def swap(d: dict[str, Any]) -> None:
        d["points"][0]["runs"]["b"] = d["points"][0]["runs"]["a"]

    edit_claim(bundle, "peers.json", swap)
    assert "peers.run_mismatch" in audit_codes(bundle)


def test_committed_bundle_passes_audit() -> None:
    assert audit_paths([COMMITTED]).findings == ()
    doc = json.loads((COMMITTED / "peers.json").read_text())
    assert doc["figures"]["n_points"] == 78
    fp = json.loads((COMMITTED / "fingerprint.json").read_text())
    assert doc["fingerprint_hash"] == fp["hash"]


def test_explanations_are_computed_from_the_runs_and_traces(published: Path) -> None:
    doc = json.loads((published / "peers.json").read_text())
    ex = doc["explanations"]
    by = {(p["tokens"], p["routing"]): p for p in doc["points"]}
    zipf, fallback = by[(4, "zipf")], by[(4, "uniform")]
    # the trace [[0,1],[0,2],[0,3],[0,4]]: expert 0 takes 4 of 8 slots, 5 experts active
    assert zipf["hot_share"] == 0.5 and zipf["active_experts"] == 5
    assert zipf["d_faster_than_c"] is True and zipf["dispatch_reason_c"] == "neighbour_tokens"
    assert fallback["c_config_is_a"] is True and fallback["c_faster_than_a"] is False
    assert zipf["uniform_floor_fraction_best"] == fallback["floor_fraction_best"]
    assert zipf["skew_cost"] == fallback["floor_fraction_best"] / zipf["floor_fraction_best"]
    assert zipf["skew_cost"] > ex["skew_cost_threshold"]
    assert [(r["tokens"], r["routing"]) for r in ex["skewed_far_from_floor"]] == [(4, "zipf")]
    assert [(r["tokens"], r["routing"]) for r in ex["d_faster_than_c"]] == [(4, "zipf")]
    assert ex["c_over_a"]["points_c_is_peer"] == 1
    gap = ex["c_over_a"]
    assert gap["points_c_faster"] + gap["points_c_within_noise"] + gap["points_c_slower"] == 3
    best = [p["median_us"]["a"] / min(p["median_us"][k] for k in "abcd" if k in p["median_us"])
            for p in doc["points"]]  # fmt: skip
    assert gap["geomean_speedup_best_over_peer"] == pytest.approx(
        (best[0] * best[1] * best[2]) ** (1 / 3)
    )
    decode_a = [p["median_us"]["a"] / p["floor_us"] for p in doc["points"]]
    assert ex["decode_geomean_floor_bound_over_a"] == pytest.approx(
        (decode_a[0] * decode_a[1] * decode_a[2]) ** (1 / 3)
    )
    report = (published / "report" / "peers.md").read_text()
    assert "## Why targets are missed" in report
    for t in doc["targets"]:
        assert (f"**{t['name']}**" in report) is (not t["passed"])
    assert "mixtral-8x7b M=4 zipf | 50.0% | 12.5%" in report


def test_tampered_explanation_is_found(bundle: Path) -> None:
    def inflate(doc: dict[str, Any]) -> None:
        doc["explanations"]["c_over_a"]["geomean_speedup_best_over_peer"] *= 1.1
        doc["explanations"]["c_over_b"]["points_c_is_peer"] += 1

    edit_claim(bundle, "peers.json", inflate)
    assert audit_codes(bundle) == {"peers.geomean_mismatch", "peers.count_mismatch"}


def test_dropped_skewed_point_and_edited_hot_share_are_found(bundle: Path) -> None:
    def drop(doc: dict[str, Any]) -> None:
        doc["explanations"]["skewed_far_from_floor"] = []
        doc["points"][1]["hot_share"] = 0.2

    edit_claim(bundle, "peers.json", drop)
    res = audit_paths([bundle])
    assert {f.check for f in res.findings} == {"peers.field_mismatch"}
    assert {f.field for f in res.findings} == {
        "explanations.skewed_far_from_floor",
        "points[1].hot_share",
    }


def test_fallback_reason_with_another_config_is_found(bundle: Path) -> None:
    def claim_fallback(doc: dict[str, Any]) -> None:
        doc["points"][1]["dispatch_reason_c"] = "tokens_out_of_range"

    edit_claim(bundle, "peers.json", claim_fallback)
    res = audit_paths([bundle])
    assert {f.check for f in res.findings} == {"peers.run_mismatch"}
    assert res.findings[0].field == "points[1].runs.c"


def test_layout_without_explanations_still_audits(bundle: Path) -> None:
    from mxdb.evidence.peers import EXTENDED_POINT_FIELDS

    def strip(doc: dict[str, Any]) -> None:
        del doc["explanations"]
        for p in doc["points"]:
            for k in EXTENDED_POINT_FIELDS:
                del p[k]

    edit_claim(bundle, "peers.json", strip)
    assert audit_codes(bundle) == set()

    def half(doc: dict[str, Any]) -> None:
        doc["points"][0]["hot_share"] = 0.5  # an extended figure in the older layout

    edit_claim(bundle, "peers.json", half)
    assert audit_codes(bundle) == {"peers.field_mismatch"}


def test_peers_workload_covers_every_point_with_its_replayed_trace() -> None:
    from mxdb.routing import classify, features
    from mxdb.shapes import preset_shape
    from mxdb.tune.traces import point_traces
    from mxdb.tune.workload import load_workload

    peers = _load("peers.py")
    path = REPO / "examples" / "workloads" / "h200-peers.yaml"
    wl = load_workload(path)
    assert len(wl.points()) == 78 and wl.dtypes == ["bf16"]
    traces = peers.workload_traces(str(path))
    assert set(traces) == {
        (f, m, k) for f in peers.FAMILIES for m in peers.TOKENS for k in peers.ROUTINGS
    }
    labels = {r.kind: i for i, r in enumerate(wl.routings)}
    for (fam, m, kind), (ids, seed) in list(traces.items())[::7]:
        shape = preset_shape(fam, m, "bf16")
        replay, _ = point_traces(wl, shape, labels[kind])
        assert seed == replay.generator["seed"] and (ids == replay.ids).all()
        # peers.py dispatches with the class the tuner stored the point's entry under
        assert str(classify(features(ids, shape.experts))) == replay.routing_class


def test_peers_workload_refuses_a_workload_without_its_routings(tmp_path: Path) -> None:
    peers = _load("peers.py")
    wl = tmp_path / "w.yaml"
    wl.write_text(
        "name: w\nmodels: [mixtral-8x7b, qwen3-30b-a3b]\ntokens: [1]\n"
        "routings: [{kind: uniform}, {kind: zipf, exponent: 1.1}, {kind: hot}]\n"
    )
    with pytest.raises(SystemExit, match="zipf"):
        peers.workload_traces(str(wl))


def test_an_edited_report_is_a_finding(bundle: Path) -> None:
    md = bundle / "report" / "peers.md"
    text = md.read_text()
    md.write_text(text.replace("| mixtral-8x7b | 4 |", "| mixtral-8x7b | 5 |", 1))
    assert md.read_text() != text
    m = json.loads((bundle / "manifest.json").read_text())
    write_manifest(bundle, bundle_id=m["bundle_id"], milestone=m["milestone"])
    assert audit_codes(bundle) == {"peers.report_mismatch"}
