"""Peers evidence of schema 1.2: K held-out routing instances per point, pooled by the verdict.

A synthetic raw output of ``benchmarks/peers.py run --heldout --instances 3`` is published and
audited; edits of pooled figures, per-instance figures, classes and raw samples are findings;
the pooled verdict differs from the verdict of one instance where the instances disagree.
With a streaming-read bandwidth in the raw output the document is schema 1.4 (the decode floor
against reads too); without one it is 1.3, as before.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bundle_edits import audit_codes, edit_claim
from test_peers_evidence import CFG_A, CFG_B, CFG_C, CFG_D, FP, REPO, _load

from mxdb import verdict
from mxdb.audit import audit_paths
from mxdb.evidence.files import dumps
from mxdb.evidence.peers import TARGETS, trace_class
from mxdb.evidence.writer import write_manifest
from mxdb.routing_gen import generate

ROUNDS = 8
#: (c)'s speedup over (a) and (b) on each instance of the disputed point: instance luck.
DISPUTED = (0.97, 1.02, 0.99)
#: The copy bandwidth of the synthetic runs, and a streaming-read bandwidth above it (schema 1.4).
COPY_BW, READ_BW = 4.2e12, 4.35e12


def _jitter(r: int, salt: int) -> float:
    """A deterministic relative jitter of at most 0.05% (round r, arm salt)."""
    h = hashlib.sha256(f"{r}|{salt}".encode()).digest()
    return (h[0] / 255.0 - 0.5) * 1e-3


def _arms(base: float, c_speedup: float, with_d: bool, i: int) -> dict[str, list[float]]:
    """Paired rounds: (a)'s three copies and (b) at ``base``; (c) ``c_speedup`` times faster."""
    rounds = [base * (1 + 0.01 * math.sin(r + i)) for r in range(ROUNDS)]  # drift per round
    arms = {
        n: [x * (1 + _jitter(r, salt + 10 * i)) for r, x in enumerate(rounds)]
        for salt, n in enumerate(("a", "ctl1", "ctl2", "b"))
    }
    arms["c"] = [x / c_speedup * (1 + _jitter(r, 7 + 10 * i)) for r, x in enumerate(rounds)]
    if with_d:
        arms["d"] = [x * 1.05 * (1 + _jitter(r, 8 + 10 * i)) for r, x in enumerate(rounds)]
    return arms


def _instance(
    i: int, tokens: int, kind: str, params: dict[str, Any], c_speedup: float, with_d: bool
) -> dict[str, Any]:
    seed = i  # at M=4 zipf, instance 1 classifies as hot and 0, 2 as uniform
    ids = generate("logits", tokens, 8, 2, seed=seed, **params)
    graph = _arms(300.0 + tokens, c_speedup, with_d, i)
    cfgs = {"a": CFG_A, "b": CFG_B, "c": CFG_C, **({"d": CFG_D} if with_d else {})}
    return {
        "instance": i,
        "seed": seed,
        "order_seed": seed,
        "routing_class": trace_class(ids.tolist(), 8),
        "ids": ids.tolist(),
        "configs": cfgs,
        "reasons": {"c": "exact_match", "d": "neighbour_tokens"},
        "answered": {},
        "correctness": {n: [0.01, 0.004, True] for n in graph},
        "graph_us": graph,
        "eager_us": {"a": [2.2 * x for x in graph["a"]], "c": [1.05 * x for x in graph["c"]]},
        "reps": ROUNDS,
        "calls_per_sample": 4,
    }


def _raw(instances: int = 3, read_bandwidth: float | None = None) -> dict[str, Any]:
    """Two points: M=4 zipf, whose instances disagree (and whose classes differ), and M=1
    uniform where (c) is clearly faster; instance 1 of the first has a (d) run.  With
    ``read_bandwidth`` the raw output records a streaming-read bandwidth (schema 1.4)."""
    zipf = {"s": 1.2}
    points = [
        {
            "family": "mixtral-8x7b",
            "tokens": 4,
            "routing": "zipf",
            "routing_params": zipf,
            "generator": "logits",
            "reps": ROUNDS,
            "calls_per_sample": 4,
            "instances": [
                _instance(i, 4, "zipf", zipf, DISPUTED[i], i == 1) for i in range(instances)
            ],
        },
        {
            "family": "mixtral-8x7b",
            "tokens": 1,
            "routing": "uniform",
            "routing_params": {},
            "generator": "logits",
            "reps": ROUNDS,
            "calls_per_sample": 4,
            "instances": [_instance(i, 1, "uniform", {}, 1.08, False) for i in range(instances)],
        },
    ]
    out: dict[str, Any] = {
        "fingerprint": FP,
        "bandwidth_bytes_per_s": COPY_BW,
        "points": points,
        "errors": [],
        "rule": "verdict",
        "instances": instances,
        "trace_source": "held-out: synthetic",
        "dispatch_cost": {"mixtral-8x7b": {"mxdb_dispatch_hit_us": 0.2, "flaggems_lookup_us": 17}},
    }
    if read_bandwidth is not None:
        out["read_bandwidth_bytes_per_s"] = read_bandwidth
    return out


def _single(raw: dict[str, Any], instance: int) -> dict[str, Any]:
    """The raw output of a single-instance held-out run (schema 1.1) timing only ``instance``."""
    out = {k: v for k, v in raw.items() if k != "instances"}
    out["points"] = []
    for p in raw["points"]:
        inst = dict(p["instances"][instance])
        for k in ("instance", "order_seed"):
            inst.pop(k)
        head = {k: v for k, v in p.items() if k != "instances"}
        out["points"].append({**head, **inst})
    return out


def _publish(raw: dict[str, Any], root: Path, name: str) -> Path:
    path = root / f"{name}.json"
    path.write_text(json.dumps(raw))
    bundle = root / name
    _load("peers.py").publish(path, bundle)
    return bundle


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _publish(_raw(), tmp_path_factory.mktemp("peers12"), "h200-peers-pooled")


@pytest.fixture(scope="module")
def published_read(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same runs with a streaming-read bandwidth: schema 1.4."""
    raw = _raw(read_bandwidth=READ_BW)
    return _publish(raw, tmp_path_factory.mktemp("peers14"), "h200-peers-pooled")


@pytest.fixture
def bundle(published: Path, tmp_path: Path) -> Path:
    dst = tmp_path / published.name
    shutil.copytree(published, dst)
    return dst


@pytest.fixture
def bundle_read(published_read: Path, tmp_path: Path) -> Path:
    dst = tmp_path / published_read.name
    shutil.copytree(published_read, dst)
    return dst


def _doc(root: Path) -> dict[str, Any]:
    return json.loads((root / "peers.json").read_text())  # type: ignore[no-any-return]


def test_pooled_bundle_audits_clean_and_holds_its_instances(published: Path) -> None:
    assert audit_codes(published) == set()
    doc = _doc(published)
    assert doc["schema_version"] == "1.3" and doc["rule"] == "verdict"
    # judged on the held-out targets: the same checks, the geomeans at 1.03x and 1.01x
    assert {t["name"] for t in doc["targets"]} == {t.name for t in TARGETS}
    thresholds = {t["name"]: t["threshold"] for t in doc["targets"]}
    assert thresholds["c_vs_flaggems_geomean"] == 1.03 and thresholds["c_vs_vllm_geomean"] == 1.01
    p = doc["points"][0]
    assert p["runs"] is None and p["trace_hash"] is None
    assert [i["instance"] for i in p["instances"]] == [0, 1, 2]
    assert p["instances"][0]["runs"]["a"] == "mixtral-m4-zipf-i0-a"
    assert [i["runs"]["d"] for i in p["instances"]] == [None, "mixtral-m4-zipf-i1-d", None]
    # the instances of one point may fall in different routing classes: each its own
    classes = [i["routing_class"] for i in p["instances"]]
    assert len(set(classes)) > 1
    assert p["routing_class"] == ",".join(dict.fromkeys(classes))
    assert doc["figures"]["n_instances"] == 6 and doc["figures"]["n_points"] == 2
    # every run of every instance is in the bundle, and its trace
    assert len(list((published / "runs").glob("*.json"))) == 2 * 3 * 5 + 1
    assert len(list((published / "traces").glob("*.json"))) == 6
    report = (published / "report" / "peers.md").read_text()
    assert "## Instances (each judged on its own rounds)" in report
    assert "instances where (c) is slower than (a) / (b) on their own rounds: 2 / 2 of 6" in report
    # no read bandwidth in the raw output: the 1.3 layout and report, without the read floor
    assert "read_bandwidth_bytes_per_s" not in doc
    assert "decode_geomean_floor_fraction_c_read" not in doc["figures"]
    c = doc["figures"]["decode_geomean_floor_fraction_c"]
    assert f"- decode (M <= 16): (c) at {c:.3f} of the floor (geomean); eager" in report


def test_pooled_figures_are_the_verdict_on_the_pooled_rounds(published: Path) -> None:
    raw = _raw()
    doc = _doc(published)
    p, inst = doc["points"][0], raw["points"][0]["instances"]
    pool = {n: [x for i in inst for x in i["graph_us"].get(n, i["graph_us"]["c"])] for n in "abcd"}
    copies = [[x for i in inst for x in i["graph_us"][n]] for n in ("a", "ctl1", "ctl2")]
    over_a = verdict.compare(copies, pool["c"])
    assert p["speedup_c_over_a"] == over_a.speedup
    assert p["noise_band"] == verdict.noise_band(copies)
    over_b = verdict.compare([pool["b"]], pool["c"], band=p["noise_band"])
    assert p["speedup_c_over_b"] == over_b.speedup
    c_over_d = verdict.paired(pool["d"], pool["c"])
    assert c_over_d is not None and p["speedup_c_over_d"] == c_over_d.speedup
    assert p["median_us"]["c"] == verdict.median(pool["c"])
    assert p["c_differs_from_d"] is True and p["c_config_is_a"] is False
    assert p["active_experts"] == pytest.approx(
        sum(i["active_experts"] for i in p["instances"]) / 3
    )
    assert p["floor_us"] == pytest.approx(sum(i["floor_us"] for i in p["instances"]) / 3)
    # the geomean target is over the pooled paired speedups
    s = [q["speedup_c_over_a"] for q in doc["points"]]
    assert doc["figures"]["geomean_speedup_c_over_a"] == pytest.approx(math.sqrt(s[0] * s[1]))


def test_pooling_absorbs_instance_luck_that_one_instance_calls_slower(
    published: Path, tmp_path: Path
) -> None:
    doc = _doc(published)
    p = doc["points"][0]
    outcomes = [(i["outcome_c_vs_a"], i["outcome_c_vs_b"]) for i in p["instances"]]
    # the copies' band is tiny here, so each instance alone is "slower" or "faster"
    assert outcomes == [("slower", "slower"), ("faster", "faster"), ("slower", "slower")]
    for i, want in zip(p["instances"], DISPUTED, strict=True):
        assert i["speedup_c_over_a"] == pytest.approx(want, rel=3e-3)
    # pooled: not distinguishable from (a) or (b); the point is not "slower"
    assert p["c_slower_than_a"] is False and p["c_slower_than_b"] is False
    assert p["speedup_c_over_a"] == pytest.approx(0.99, rel=3e-3)
    assert doc["figures"]["points_c_slower_than_a"] == 0
    assert doc["figures"]["points_c_slower_than_b"] == 0
    # ... and the instances behind it stay visible
    assert doc["figures"]["instances_c_slower_than_a"] == sum(
        1 for q in doc["points"] for i in q["instances"] if i["outcome_c_vs_a"] == "slower"
    )
    refs = doc["explanations"]["instances_c_slower_than_a"]
    assert [(r["tokens"], r["figures"]["instance"]) for r in refs][:1] == [(4, 0)]
    assert refs[0]["figures"]["pooled_c_slower_than_a"] is False
    # the same data judged on instance 0 alone (schema 1.1): the point is "slower"
    single = _publish(_single(_raw(), 0), tmp_path, "h200-peers-single")
    assert audit_codes(single) == set()
    one = _doc(single)
    assert one["schema_version"] == "1.1" and "instances" not in one["points"][0]
    assert one["points"][0]["c_slower_than_a"] is True
    assert one["points"][0]["c_slower_than_b"] is True
    assert one["figures"]["points_c_slower_than_a"] == 1
    assert "n_instances" not in one["figures"]
    assert "instances_c_slower_than_a" not in one["explanations"]


def test_tampered_pooled_figure_is_found(bundle: Path) -> None:
    def inflate(doc: dict[str, Any]) -> None:
        doc["points"][0]["speedup_c_over_a"] *= 1.01

    edit_claim(bundle, "peers.json", inflate)
    assert audit_codes(bundle) == {"peers.ratio_mismatch"}


def test_flipped_pooled_verdict_and_count_are_found(bundle: Path) -> None:
    def flip(doc: dict[str, Any]) -> None:
        doc["points"][0]["c_slower_than_a"] = True
        doc["figures"]["instances_c_slower_than_b"] -= 1

    edit_claim(bundle, "peers.json", flip)
    assert audit_codes(bundle) == {"peers.flag_mismatch", "peers.count_mismatch"}


def test_tampered_instance_figures_are_found(bundle: Path) -> None:
    def edit(doc: dict[str, Any]) -> None:
        doc["points"][0]["instances"][0]["outcome_c_vs_a"] = "same"
        doc["points"][0]["instances"][2]["speedup_c_over_b"] = 1.0

    edit_claim(bundle, "peers.json", edit)
    assert audit_codes(bundle) == {"peers.flag_mismatch", "peers.ratio_mismatch"}


def test_edited_instance_class_is_found(bundle: Path) -> None:
    def reclass(doc: dict[str, Any]) -> None:
        inst = doc["points"][0]["instances"][1]
        inst["routing_class"] = "uniform" if inst["routing_class"] != "uniform" else "hot"

    edit_claim(bundle, "peers.json", reclass)
    res = audit_paths([bundle])
    assert {f.check for f in res.findings} == {"peers.field_mismatch"}
    assert {f.field for f in res.findings} == {"points[0].instances[1].routing_class"}


def test_tampered_run_sample_is_found(bundle: Path) -> None:
    def bump(doc: dict[str, Any]) -> None:
        s = doc["timing"]["samples_us"]
        doc["timing"]["samples_us"] = [x * 0.9 for x in s]
        doc["timing"]["median_us"] *= 0.9
        doc["timing"]["p90_us"] *= 0.9

    edit_claim(bundle, "runs/mixtral-m4-zipf-i2-c.json", bump)
    checks = audit_codes(bundle)
    assert {"peers.median_mismatch", "peers.ratio_mismatch"} <= checks


def test_instance_runs_are_checked_against_their_own_trace(bundle: Path) -> None:
    def swap(doc: dict[str, Any]) -> None:
        insts = doc["points"][0]["instances"]
        insts[0]["runs"]["b"] = insts[1]["runs"]["b"]

    edit_claim(bundle, "peers.json", swap)
    assert "peers.run_mismatch" in audit_codes(bundle)

    def renumber(doc: dict[str, Any]) -> None:
        doc["points"][0]["instances"][2]["instance"] = 5

    edit_claim(bundle, "peers.json", renumber)
    assert "peers.field_mismatch" in audit_codes(bundle)


def test_dropped_instance_is_found(bundle: Path) -> None:
    def drop(doc: dict[str, Any]) -> None:
        del doc["points"][0]["instances"][2]

    edit_claim(bundle, "peers.json", drop)
    assert audit_codes(bundle)


def _leaves(x: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _leaves(v, (*path, i))
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        yield path, x


@pytest.mark.parametrize("layout", ["1.3", "1.4"])
def test_every_numeric_figure_of_the_pooled_layout_is_checked(
    layout: str, request: pytest.FixtureRequest
) -> None:
    """Like tests/test_every_figure.py (which sweeps committed bundles; no 1.2 bundle is
    committed yet): each distinct numeric leaf of ``peers.json`` but the recorded dispatch
    costs, edited in turn, is a finding; in 1.4 the read bandwidth and its floor fraction too."""
    bundle: Path = request.getfixturevalue("bundle_read" if layout == "1.4" else "bundle")
    name = "peers.json"
    original = (bundle / name).read_bytes()
    manifest = (bundle / "manifest.json").read_bytes()
    meta = json.loads(manifest)
    seen: dict[str, tuple[Any, ...]] = {}
    for path, _ in _leaves(json.loads(original)):
        if path[0] == "dispatch_cost":  # host measurements, reported as measured (inputs)
            continue
        seen.setdefault(".".join("*" if isinstance(p, int) else str(p) for p in path), path)
    missed = []
    for path in seen.values():
        doc = json.loads(original)
        node = doc
        for p in path[:-1]:
            node = node[p]
        v = node[path[-1]]
        node[path[-1]] = v + 1 if isinstance(v, int) else v + max(abs(v) * 0.01, 0.01)
        (bundle / name).write_text(json.dumps(doc, indent=1))
        write_manifest(bundle, bundle_id=meta["bundle_id"], milestone=meta["milestone"])
        if not any(f.file.endswith(name) for f in audit_paths([bundle]).findings):
            missed.append(path)
        (bundle / name).write_bytes(original)
        (bundle / "manifest.json").write_bytes(manifest)
    assert len(seen) > 40
    assert not missed
    read = {"read_bandwidth_bytes_per_s", "figures.decode_geomean_floor_fraction_c_read"}
    assert (read <= set(seen)) is (layout == "1.4")


def test_heldout_seed_of_instance_0_is_the_single_instance_seed() -> None:
    peers = _load("peers.py")
    old = int.from_bytes(hashlib.sha256(b"peers-heldout|qwen3-30b-a3b|64|zipf").digest()[:4], "big")
    assert peers.heldout_seed("qwen3-30b-a3b", 64, "zipf") == old
    assert peers.heldout_seed("qwen3-30b-a3b", 64, "zipf", 0) == old
    seeds = {peers.heldout_seed("qwen3-30b-a3b", 64, "zipf", i) for i in range(3)}
    assert len(seeds) == 3
    # the committed single-instance held-out bundle drew its traces with those seeds
    root = REPO / "evidence" / "h200-peers-heldout"
    doc = json.loads((root / "peers.json").read_text())
    for p in doc["points"][::11]:
        trace = json.loads((root / "traces" / f"{p['trace_hash']}.json").read_text())
        want = peers.heldout_seed(p["family"], p["tokens"], p["routing"], 0)
        assert trace["generator"]["seed"] == want


def test_instance_rounds_keep_the_run_time_and_the_minimum() -> None:
    peers = _load("peers.py")
    assert peers.instance_reps(64, 1) == (15, 4)
    assert peers.instance_reps(512, 1) == (7, 2)
    assert peers.instance_reps(64, 3) == (8, 4)  # 24 pooled rounds, 1.6x of 15
    assert peers.instance_reps(4096, 3) == (6, 2)  # the sign test's minimum per instance
    for m in peers.TOKENS:
        for k in range(1, 6):
            reps, _ = peers.instance_reps(m, k)
            assert reps >= verdict.MIN_ROUNDS


def test_a_pooled_document_of_schema_1_2_keeps_its_targets(published: Path, tmp_path: Path) -> None:
    """1.2 documents (before the held-out targets) audit by the targets they were written with;
    a 1.2 document carrying the held-out thresholds, or a 1.3 one the earlier, is a finding."""
    from mxdb.evidence.peers import HELDOUT_TARGETS, REPORT_FILE, build_targets, render
    from mxdb.evidence.writer import write_manifest

    def rewrite(version: str, specs: Any) -> set[str]:
        dst = tmp_path / f"b{version}{len(specs)}{specs[0].threshold}"
        shutil.copytree(published, dst)
        doc = _doc(dst)
        doc["schema_version"] = version
        doc["targets"] = build_targets(doc["figures"], specs)
        (dst / "peers.json").write_bytes(dumps(doc))
        (dst / REPORT_FILE).write_text(render(doc))
        write_manifest(dst, bundle_id="h200-peers-pooled", milestone="h200-peers-pooled")
        return audit_codes(dst)

    assert rewrite("1.2", TARGETS) == set()
    assert "peers.target_threshold_mismatch" in rewrite("1.2", HELDOUT_TARGETS)
    assert "peers.target_threshold_mismatch" in rewrite("1.3", TARGETS)


def test_a_read_bandwidth_makes_a_1_4_document_with_the_read_floor(
    published: Path, published_read: Path
) -> None:
    """Schema 1.4: the raw output's streaming-read bandwidth is an input of ``peers.json``, and
    (c)'s decode floor fraction against it is the copy one x copy / read bandwidth; all else
    is the 1.3 document of the same runs.  It validates and audits clean."""
    from mxdb import schemas
    from mxdb.evidence.peers import HELDOUT_TARGETS, PeersDoc

    assert audit_codes(published_read) == set()
    doc = _doc(published_read)
    assert doc["schema_version"] == "1.4" and doc["read_bandwidth_bytes_per_s"] == READ_BW
    c = doc["figures"]["decode_geomean_floor_fraction_c"]
    read = doc["figures"]["decode_geomean_floor_fraction_c_read"]
    assert read == pytest.approx(c * COPY_BW / READ_BW, rel=1e-15)
    assert read < c  # reads alone run faster than a copy: the read floor is lower
    assert [t["threshold"] for t in doc["targets"]] == [t.threshold for t in HELDOUT_TARGETS]
    PeersDoc.model_validate(doc)
    schemas.validator("peers", "1.4").validate(doc)
    # the same runs without the read bandwidth: the 1.3 document, figure for figure
    same = json.loads(json.dumps(doc))
    del same["read_bandwidth_bytes_per_s"], same["figures"]["decode_geomean_floor_fraction_c_read"]
    assert {**same, "schema_version": "1.3"} == _doc(published)
    report = (published_read / "report" / "peers.md").read_text()
    assert (
        f"- decode (M <= 16): (c) at {c:.3f} of the copy-bandwidth floor (4.20 TB/s), "
        f"{read:.3f} of the streaming-read floor (4.35 TB/s) (geomean); eager" in report
    )


def _copy(src: Path, root: Path, name: str) -> Path:
    dst = root / name / src.name
    shutil.copytree(src, dst)
    return dst


def test_edited_read_floor_or_read_bandwidth_is_found(published_read: Path, tmp_path: Path) -> None:
    """The read floor's figure is recomputed from the recorded read bandwidth: editing either
    (the report re-rendered to match) is a finding on the figure, and so is dropping the read
    bandwidth, or calling the document 1.3 (a layout without it)."""

    def figure(doc: dict[str, Any]) -> None:
        doc["figures"]["decode_geomean_floor_fraction_c_read"] *= 1.01

    def bandwidth(doc: dict[str, Any]) -> None:
        doc["read_bandwidth_bytes_per_s"] *= 0.98  # a lower read bandwidth flatters (c)

    def drop(doc: dict[str, Any]) -> None:
        del doc["read_bandwidth_bytes_per_s"]

    want = {("peers.geomean_mismatch", "figures.decode_geomean_floor_fraction_c_read")}
    for change in (figure, bandwidth, drop):
        b = _copy(published_read, tmp_path, change.__name__)
        edit_claim(b, "peers.json", change)
        assert {(f.check, f.field) for f in audit_paths([b]).findings} == want, change.__name__

    def relabel(doc: dict[str, Any]) -> None:
        doc["schema_version"] = "1.3"

    b = _copy(published_read, tmp_path, "relabel")
    edit_claim(b, "peers.json", relabel)
    assert audit_codes(b)


def test_old_raw_layouts_publish_as_before(tmp_path: Path) -> None:
    """A single-instance held-out raw output still publishes as schema 1.1."""
    bundle = _publish(_single(_raw(), 2), tmp_path, "h200-peers-old")
    doc = _doc(bundle)
    assert doc["schema_version"] == "1.1"
    assert doc["points"][0]["runs"]["a"] == "mixtral-m4-zipf-a"
    assert all("instances" not in p for p in doc["points"])
    assert audit_codes(bundle) == set()


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, calls: list[dict[str, Any]]) -> None:
    """Stand-ins for torch, FlagGems and mxdb's kernels, so ``run`` executes on a CPU."""
    import sys
    import types

    from mxdb.configs import KernelConfig

    class Tensor:
        def cuda(self) -> Tensor:
            return self

        def clone(self) -> Tensor:
            return self

    class Fingerprint:
        hash = "0" * 16
        device_name = "NVIDIA H200"

        def components(self) -> dict[str, Any]:
            return dict(FP)

    class Backend:
        def fingerprint(self) -> Fingerprint:
            return Fingerprint()

        def compile_raw(self, specs: list[Any]) -> None:
            calls.append({"compiled": len(specs)})

        def close(self) -> None:
            pass

    class Callable_:
        def __init__(self, *args: Any) -> None:
            pass

        def __call__(self, *args: Any) -> Tensor:
            return Tensor()

    def time_interleaved(fns: list[Any], **kw: Any) -> list[list[float]]:
        for f in fns:
            f()
        calls.append({"arms": len(fns), **kw})
        return [[100.0 + j + 0.01 * r for r in range(kw["reps"])] for j in range(len(fns))]

    result = types.SimpleNamespace(max_abs_err=0.01, rel_err=0.004, passed=True)
    fakes = {
        "torch": {
            "from_numpy": lambda a: Tensor(),
            "cuda": types.SimpleNamespace(empty_cache=lambda: None),
        },
        "flag_gems": {},
        "flag_gems.fused": {},
        "flag_gems.fused.fused_moe": {"fused_experts_impl": lambda *a: Tensor()},
        "mxdb.kernels": {},
        "mxdb.kernels.backend": {"GpuBackend": Backend, "flaggems_config": lambda s: None},
        "mxdb.kernels.compile": {"specs_for": lambda shape, c: [c.hash]},
        "mxdb.kernels.layer": {
            "MoELayer": Callable_,
            "flaggems_kernel_config": lambda s: KernelConfig.model_validate(CFG_A),
        },
        "mxdb.kernels.pipeline": {"MoEPipeline": Callable_},
        "mxdb.kernels.reference": {
            "compare": lambda *a: result,
            "make_activations": lambda *a: (Tensor(), Tensor(), Tensor()),
            "make_weights": lambda *a: (Tensor(), Tensor()),
            "moe_reference": lambda *a: Tensor(),
        },
        "mxdb.kernels.timing": {
            "time_interleaved": time_interleaved,
            # bytes per second of 3 reads; the median time's is 4.3e12
            "read_bandwidth_samples": lambda: [4.0e12, 4.4e12, 4.3e12],
        },
    }
    for name, attrs in fakes.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)


def test_heldout_run_times_each_instance_on_its_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``run --heldout --instances 3`` on stand-ins for the GPU: each point's raw output holds
    three instances, dispatched for their own class against the real store export, each timed
    in its own rounds with its own order seed; ``publish`` makes an audit-clean 1.2 bundle."""
    import argparse

    from mxdb.incumbent import incumbent
    from mxdb.routing import classify, features
    from mxdb.shapes import preset_shape

    peers = _load("peers.py")
    calls: list[dict[str, Any]] = []
    _fake_gpu(monkeypatch, calls)
    monkeypatch.setattr(peers, "bandwidth", lambda: 4.2e12)
    monkeypatch.setattr(peers, "dispatch_cost", lambda d, s: {"mxdb_dispatch_hit_us": 0.2})
    out = tmp_path / "raw.json"
    a = argparse.Namespace(
        out=str(out),
        store_export=str(REPO / "evidence" / "store-export.json"),
        workload=None,
        deadline_s=1e9,
        heldout=True,
        instances=3,
        salt="s1",
        data_use="test",
        families=list(peers.FAMILIES),
        zero_shot=False,
        perf_model=None,
    )
    peers.run(a)
    raw = json.loads(out.read_text())
    assert raw["errors"] == [] and raw["rule"] == "verdict" and raw["instances"] == 3
    assert raw["bandwidth_bytes_per_s"] == 4.2e12 and raw["read_bandwidth_bytes_per_s"] == 4.3e12
    assert len(raw["points"]) == 78
    for p in raw["points"]:
        assert [i["instance"] for i in p["instances"]] == [0, 1, 2]
        experts = {"mixtral-8x7b": 8, "qwen3-30b-a3b": 128}[p["family"]]
        for i in p["instances"]:
            want = peers.heldout_seed(p["family"], p["tokens"], p["routing"], i["instance"], "s1")
            assert i["seed"] == i["order_seed"] == want
            unsalted = peers.heldout_seed(p["family"], p["tokens"], p["routing"], i["instance"])
            assert want != unsalted  # a salt draws new instances
            # (b) is the incumbent: vLLM's shipped H200 table row for the point
            shape = preset_shape(p["family"], p["tokens"], "bf16")
            assert i["configs"]["b"] == incumbent(shape, "NVIDIA H200").config.model_dump()
            assert i["routing_class"] == str(classify(features(i["ids"], experts)))
            reps, cps = peers.instance_reps(p["tokens"], 3)
            assert all(len(s) == reps for s in i["graph_us"].values())
            assert (i["reps"], i["calls_per_sample"]) == (reps, cps)
            assert i["configs"]["c"] and set(i["reasons"]) == {"c", "d"}
            assert i["correctness"]["ctl1"][2] is True
    graph = [c for c in calls if c.get("method") == "graph"]
    assert len(graph) == 78 * 3
    assert [c["order_seed"] for c in graph[:3]] == [
        i["seed"] for i in raw["points"][0]["instances"]
    ]
    bundle = tmp_path / "h200-peers-pooled"
    peers.publish(out, bundle)
    assert audit_codes(bundle) == set()
    doc = _doc(bundle)
    assert doc["schema_version"] == "1.5" and doc["figures"]["n_instances"] == 234
    assert doc["read_bandwidth_bytes_per_s"] == 4.3e12
    assert (doc["seed_salt"], doc["data_use"]) == ("s1", "test")
    assert {t["name"] for t in doc["targets"]} >= {
        "c_vs_incumbent_geomean", "c_never_slower_than_incumbent", "routing_aware_never_slower"
    }  # fmt: skip


def test_sparse_workload_covers_the_class_heldout_zipf_instances_of_qwen3_fall_in() -> None:
    from mxdb.routing import classify, features
    from mxdb.shapes import preset_shape
    from mxdb.tune.traces import point_traces
    from mxdb.tune.workload import SparseRouting, load_workload

    peers = _load("peers.py")
    wl = load_workload(REPO / "examples" / "workloads" / "h200-peers-sparse.yaml")
    assert [m.label for m in wl.models] == ["qwen3-30b-a3b"] and wl.dtypes == ["bf16"]
    assert wl.tokens == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    assert wl.routings == [SparseRouting(active=0.25)]
    assert len(wl.points()) == 9
    # the search options are h200-peers.yaml's
    assert wl.search == load_workload(REPO / "examples" / "workloads" / "h200-peers.yaml").search
    fam = preset_shape("qwen3-30b-a3b", 1, "bf16")
    assert (fam.experts, fam.topk) == (128, 8)
    for m in wl.tokens:
        replay, _ = point_traces(wl, fam.with_tokens(m), 0)
        assert replay.routing_class == "sparse", m
        for seed in range(3):  # other instances of the kind too
            ids = generate("sparse", m, 128, 8, seed=seed, active=0.25)
            assert str(classify(features(ids, 128))) == "sparse", (m, seed)
    # ... the class the held-out Zipf instances of Qwen3 fall in from M = 16 to 1024
    for m in (16, 32, 64, 128, 256, 512, 1024):
        for i in range(3):
            seed = peers.heldout_seed("qwen3-30b-a3b", m, "zipf", i)
            ids = generate("logits", m, 128, 8, seed=seed, **peers.HELDOUT["zipf"])
            assert str(classify(features(ids, 128))) == "sparse", (m, i)


def test_skewed2_and_decode_workloads_cover_the_keys_they_say() -> None:
    from mxdb.configs import FUSED_SLICE_MAX_SLOTS
    from mxdb.routing import classify, features
    from mxdb.tune.runner import build_points, validation_traces
    from mxdb.tune.workload import load_workload

    peers = _load("peers.py")
    base = load_workload(REPO / "examples" / "workloads" / "h200-peers.yaml")
    # the decode workload is h200-peers.yaml at the M where fused_slice is searched for Qwen3
    decode = load_workload(REPO / "examples" / "workloads" / "h200-peers-decode.yaml")
    assert decode.search == base.search and decode.routings == base.routings
    assert decode.models == base.models and decode.tokens == [1, 2, 4, 8, 16, 32, 64]
    assert max(decode.tokens) * 8 == FUSED_SLICE_MAX_SLOTS and len(decode.points()) == 42
    # skewed2: one Qwen3 point at M = 2 whose replay and held-out instances are all `skewed`
    wl = load_workload(REPO / "examples" / "workloads" / "h200-peers-skewed2.yaml")
    assert wl.search == base.search
    ((p, replay, _),) = build_points(wl)
    assert (p.shape.experts, p.shape.topk, p.shape.tokens) == (128, 8, 2)
    assert replay.routing_class == "skewed"
    assert {t.routing_class for t in validation_traces(wl, p, replay)["heldout"]} == {"skewed"}
    # ... the class all three held-out Zipf instances of the peers comparison fall in at M = 2,
    # which h200-peers.yaml's sources do not reach there
    for i in range(3):
        seed = peers.heldout_seed("qwen3-30b-a3b", 2, "zipf", i)
        ids = generate("logits", 2, 128, 8, seed=seed, **peers.HELDOUT["zipf"])
        assert str(classify(features(ids, 128))) == "skewed", i
    assert all(
        r.routing_class != "skewed"
        for q, r, _ in build_points(base)
        if q.shape.experts == 128 and q.shape.tokens == 2
    )


def test_sparse_routing_in_a_workload() -> None:
    from mxdb.errors import WorkloadError
    from mxdb.tune.workload import parse_workload

    wl = parse_workload(
        {"name": "s", "models": ["qwen3-30b-a3b"], "tokens": [64], "routings": [{"kind": "sparse"}]}
    )
    assert wl.routings[0].label() == "sparse0.25"
    with pytest.raises(WorkloadError):
        parse_workload(
            {
                "name": "s",
                "models": ["qwen3-30b-a3b"],
                "tokens": [64],
                "routings": [{"kind": "sparse", "active": 0}],
            }
        )


def test_where_c_ran_a_peers_own_config_it_is_that_config(tmp_path: Path) -> None:
    """Schema 1.3: an instance on which (c) ran (b)'s config is compared with (b) as itself (one
    kernel), whatever its own timing says; its median stays the measured one.  A 1.2 document
    of the same runs keeps the measured comparison."""
    raw = _raw()
    for inst in raw["points"][0]["instances"]:
        inst["configs"]["c"] = CFG_B  # (c) answered vLLM's row; its timing 0.97-1.02x of (b)'s
    bundle = _publish(raw, tmp_path, "h200-peers-same")
    assert audit_codes(bundle) == set()
    p = _doc(bundle)["points"][0]
    assert p["c_config_is_b"] is True
    assert p["speedup_c_over_b"] == 1.0 and p["c_slower_than_b"] is False
    assert all(i["speedup_c_over_b"] == 1.0 and i["outcome_c_vs_b"] == "same"
               for i in p["instances"])  # fmt: skip
    medians = [i["median_us"] for i in p["instances"]]
    assert any(m["c"] != m["b"] for m in medians)  # the timings themselves are as measured
    # the same runs as a 1.2 document: compared as timed (instance 0 is 0.97x: slower)
    from mxdb.evidence.peers import build_peers

    doc = _doc(bundle)
    runs = {r.stem: json.loads(r.read_text()) for r in (bundle / "runs").glob("*.json")}
    traces = {t.stem: json.loads(t.read_text()) for t in (bundle / "traces").glob("*.json")}
    points = [{k: v for k, v in q.items() if k in ("family", "tokens", "routing", "instances")}
              for q in doc["points"]]  # fmt: skip
    old = build_peers(
        points, runs, {h: len({e for row in t["ids"] for e in row}) for h, t in traces.items()},
        milestone="m", fingerprint_hash=doc["fingerprint_hash"],
        bandwidth_bytes_per_s=doc["bandwidth_bytes_per_s"], rule="verdict",
        hot_shares=dict.fromkeys(traces, 0.0),
        trace_classes={h: trace_class(t["ids"], 8) for h, t in traces.items()},
        schema_version="1.2",
    )  # fmt: skip
    q = old["points"][0]
    assert old["schema_version"] == "1.2"
    assert q["instances"][0]["outcome_c_vs_b"] == "slower" and q["speedup_c_over_b"] != 1.0
