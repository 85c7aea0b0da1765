"""Performance-sweep evidence (``sweep.json``): publish from raw output, audit, tampering findings.

The small bundle here is synthetic: a few families, token counts and routing sources, with the
routing really generated (counts, trace hash and class as ``benchmarks/perf_sweep.py run``
records them) and samples drawn so that some candidates are faster than FlagGems' choice, some
the same and some slower; it is published with ``benchmarks/perf_sweep.py publish``.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from benchmark_scripts import load
from bundle_edits import audit_codes, edit_claim

from mxdb import verdict
from mxdb.audit import CHECKS, audit_paths
from mxdb.configs import KernelConfig
from mxdb.costmodel.menu import menu
from mxdb.evidence.sweep import MARGIN, REPORT_FILE, SWEEP_FILE
from mxdb.evidence.writer import write_manifest
from mxdb.fingerprint import H200
from mxdb.resources import flaggems_default_config
from mxdb.routing import expert_counts, trace_hash
from mxdb.routing_gen import generate
from mxdb.shapes import preset_shape
from mxdb.tune.traces import classify

EVIDENCE = Path(__file__).resolve().parents[1] / "evidence"
FP = {k: v for k, v in H200.items() if k != "mxdb"}
FAMILIES = ("mixtral-8x7b", "olmoe-1b-7b", "qwen3-30b-a3b", "deepseek-v2-lite")
TOKENS = (1, 64)
SOURCES = ("uniform", "hot0.5")
#: candidates timed per key (the first of the menu that are not FlagGems' choice)
CANDIDATES = 6


def raw_sweep(
    families: Sequence[str] = FAMILIES,
    tokens: Sequence[int] = TOKENS,
    sources: Sequence[str] = SOURCES,
    fingerprint: dict[str, Any] | None = None,
    seed: int = 3,
) -> dict[str, Any]:
    """A raw file as ``benchmarks/perf_sweep.py run`` writes it, with drawn samples: the first
    candidate takes FlagGems' time, the others its time by a factor between 0.85 and 1.15
    drawn from their config hash (a fixed function of the config, so that a model has
    something to learn); one more menu config is out of resources."""
    ps = load("perf_sweep.py")
    rng = random.Random(seed)

    def samples(center: float) -> list[float]:
        return [center * (1 + rng.uniform(-0.004, 0.004)) for _ in range(ps.ROUNDS)]

    keys = []
    for fam in families:
        for m in tokens:
            shape = preset_shape(fam, m, "bf16")
            restated = flaggems_default_config(shape)
            base = KernelConfig.uniform(restated)
            cands = [c for c in menu(shape) if c.hash != base.hash]
            timed, oor = cands[:CANDIDATES], cands[CANDIDATES]
            for source in sources:
                kind, params = ps.ROUTINGS[source]
                key_seed = ps.key_seed(fam, m, source)
                ids = generate(kind, m, shape.experts, shape.topk, key_seed, **params)
                center = 20.0 + 0.05 * m * shape.topk
                arms = [
                    {"config": base.model_dump(), "role": role, "status": "ok",
                     "samples": samples(center), "error": None}
                    for role in ("baseline", "control", "control")
                ]  # fmt: skip
                for j, c in enumerate(timed):
                    factor = 1.0 if j == 0 else 0.85 + 0.3 * int(c.hash[:4], 16) / 0xFFFF
                    arms.append({"config": c.model_dump(), "role": "candidate", "status": "ok",
                                 "samples": samples(center * factor), "error": None})  # fmt: skip
                arms.append({"config": oor.model_dump(), "role": "candidate", "status": "oor",
                             "samples": [], "error": "needs too much shared memory"})  # fmt: skip
                keys.append({
                    "family": fam, "shape": shape.to_dict(), "tokens": m, "source": source,
                    "routing": {"kind": kind, "params": params, "seed": key_seed},
                    "trace_hash": trace_hash(ids, shape.experts),
                    "counts": [int(x) for x in expert_counts(np.asarray(ids), shape.experts)],
                    "routing_class": classify(ids, shape.experts),
                    "baseline": base.model_dump(), "baseline_restated": restated.model_dump(),
                    "rounds": ps.ROUNDS, "calls_per_sample": ps.calls_per_sample(m),
                    "arms": arms,
                })  # fmt: skip
    return {"fingerprint": fingerprint or FP, "keys": keys, "errors": []}


def synthetic_sweep_bundle(
    parent: Path, name: str = "h200-perf-sweep", raw: dict[str, Any] | None = None
) -> Path:
    """The bundle ``benchmarks/perf_sweep.py publish`` writes from :func:`raw_sweep` (or
    ``raw``) into ``parent / name``."""
    parent.mkdir(parents=True, exist_ok=True)
    src = parent / f"{name}.raw.json"
    src.write_text(json.dumps(raw or raw_sweep()))
    out = Path(load("perf_sweep.py").publish([src], parent / name))
    src.unlink()
    return out


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic_sweep_bundle(tmp_path_factory.mktemp("sweep"))


def _edited(bundle: Path, tmp_path: Path, edit: Any) -> set[str]:
    """The finding codes of a copy of ``bundle`` whose ``sweep.json`` ``edit`` changed (its
    report re-rendered and its manifest re-written, as a careful forger would)."""
    dst = tmp_path / "b"
    shutil.copytree(bundle, dst)
    edit_claim(dst, SWEEP_FILE, edit)
    return audit_codes(dst)


def test_published_bundle_audits_clean_with_figures_from_the_samples(bundle: Path) -> None:
    assert list(audit_paths([bundle]).findings) == []
    doc = json.loads((bundle / SWEEP_FILE).read_text())
    assert (doc["rounds"], doc["copies"], doc["margin"], doc["method"]) == (7, 3, 0.005, "graph")
    keys = doc["keys"]
    n = len(FAMILIES) * len(TOKENS) * len(SOURCES)
    f = doc["figures"]
    assert (f["keys"], f["families"], f["keys_with_candidate"]) == (n, len(FAMILIES), n)
    assert f["arms"] == {"ok": n * (3 + CANDIDATES), "oor": n, "compile_error": 0,
                         "wrong": 0, "timeout": 0}  # fmt: skip
    outcomes = {a["outcome"] for k in keys for a in k["arms"] if a["role"] == "candidate"}
    assert outcomes == {"faster", "slower", "same", None}
    for k in keys:
        copies = [a["samples"] for a in k["arms"] if a["role"] != "candidate"]
        cands = [a for a in k["arms"] if a["role"] == "candidate" and a["samples"]]
        best = max(cands, key=lambda a: a["speedup"])
        assert k["best"]["config_hash"] == best["config_hash"] == KernelConfig.model_validate(
            best["config"]).hash  # fmt: skip
        v = verdict.compare(copies, best["samples"], margin=MARGIN)
        assert (k["best"]["speedup"], k["best"]["outcome"]) == (v.speedup, v.outcome)
        assert k["noise_band"] == verdict.noise_band(copies)
        oor = next(a for a in k["arms"] if a["status"] == "oor")
        assert (oor["median_us"], oor["speedup"], oor["outcome"]) == (None, None, None)
        assert all(a["speedup"] is None for a in k["arms"] if a["role"] != "candidate")
    fam = f["by_family"]["olmoe-1b-7b"]
    assert fam["keys"] == len(TOKENS) * len(SOURCES)
    assert sum(g["keys"] for g in f["by_impl"].values()) == n
    assert (bundle / REPORT_FILE).read_text().startswith("# Performance sweep")


def _arm(d: dict[str, Any], i: int, role: str = "candidate") -> dict[str, Any]:
    arm: dict[str, Any] = next(
        a for a in d["keys"][i]["arms"] if a["role"] == role and a["samples"]
    )
    return arm


def _scale(arm: dict[str, Any], factor: float) -> None:
    """Every sample of ``arm`` times ``factor`` (its claimed figures left as they were)."""
    arm["samples"] = [x * factor for x in arm["samples"]]


@pytest.mark.parametrize(
    ("edit", "code"),
    [
        (lambda d: _arm(d, 0)["samples"].__setitem__(0, -1.0), "sweep.sample_invalid"),
        (lambda d: _scale(_arm(d, 0), 1.3), "sweep.median_mismatch"),
        (lambda d: _scale(_arm(d, 1), 0.7), "sweep.speedup_mismatch"),
        (lambda d: _arm(d, 1).__setitem__("median_us", 1.0), "sweep.median_mismatch"),
        (lambda d: _arm(d, 1).__setitem__("speedup", 2.0), "sweep.speedup_mismatch"),
        (lambda d: _arm(d, 2).__setitem__("outcome", "faster" if _arm(d, 2)["outcome"] != "faster"
                                          else "slower"), "sweep.verdict_mismatch"),
        (lambda d: _arm(d, 2).__setitem__("config_hash", "0" * 16), "sweep.config_hash_mismatch"),
        (lambda d: _scale(_arm(d, 3, "baseline"), 1.5), "sweep.noise_band_mismatch"),
        (lambda d: d["keys"][3].__setitem__("noise_band", 0.5), "sweep.noise_band_mismatch"),
        (lambda d: d["keys"][3].__setitem__("baseline_median_us", 9.0), "sweep.median_mismatch"),
        (lambda d: d["keys"][4]["best"].__setitem__("speedup", 3.0), "sweep.best_mismatch"),
        (lambda d: d["keys"][4]["best"].__setitem__("impl", "fused_act"), "sweep.best_mismatch"),
        (lambda d: d["figures"].__setitem__("geomean_best_speedup", 2.0), "sweep.geomean_mismatch"),
        (lambda d: d["figures"]["arms"].__setitem__("ok", 1), "sweep.count_mismatch"),
        (lambda d: d["figures"]["by_family"]["mixtral-8x7b"].__setitem__("best_faster", 0),
         "sweep.count_mismatch"),
        (lambda d: d["keys"][5]["counts"].__setitem__(0, d["keys"][5]["counts"][0] + 1),
         "sweep.counts_invalid"),
        (lambda d: d["keys"][5]["counts"].pop(), "sweep.counts_invalid"),
        (lambda d: d["keys"][5].__setitem__("counts", sorted(d["keys"][5]["counts"])),
         "sweep.routing_mismatch"),
        (lambda d: d["keys"][5]["routing"].__setitem__("seed", 7), "sweep.routing_mismatch"),
        (lambda d: d["keys"][5].__setitem__("trace_hash", "0" * 16), "sweep.routing_mismatch"),
        (lambda d: d["keys"][1].__setitem__("routing_class", "sparse"), "sweep.class_mismatch"),
        (lambda d: d["keys"][0]["shape"].__setitem__("hidden", 1024), "sweep.shape_mismatch"),
        (lambda d: d["keys"][0].__setitem__("family", "mixtral-8x22b"), "sweep.shape_mismatch"),
        (lambda d: d["keys"][0]["arms"][-1]["config"]["gemm1"].__setitem__("block_m", 17),
         "sweep.config_invalid"),
        (lambda d: d["keys"][0]["arms"][-1].__setitem__("samples", [20.0] * 7), "sweep.arms_invalid"),
        (lambda d: _arm(d, 0, "control").__setitem__("role", "candidate"), "sweep.arms_invalid"),
        (lambda d: _arm(d, 0)["samples"].pop(), "sweep.arms_invalid"),
        (lambda d: d["keys"][0].__setitem__("rounds", 8), "sweep.field_mismatch"),
        (lambda d: d.__setitem__("margin", 0.0), "sweep.field_mismatch"),
        (lambda d: d.__setitem__("fingerprint_hash", "0" * 16), "sweep.fingerprint_mismatch"),
        (lambda d: d["keys"].append(json.loads(json.dumps(d["keys"][0]))), "sweep.duplicate_key"),
    ],
)  # fmt: skip
def test_every_kind_of_edit_is_a_finding(
    bundle: Path, tmp_path: Path, edit: Any, code: str
) -> None:
    assert code in _edited(bundle, tmp_path, edit)
    assert code in CHECKS


def test_an_edited_report_is_a_finding(bundle: Path, tmp_path: Path) -> None:
    dst = tmp_path / "b"
    shutil.copytree(bundle, dst)
    md = dst / REPORT_FILE
    md.write_text(md.read_text().replace("| olmoe-1b-7b | 4 |", "| olmoe-1b-7b | 5 |"))
    write_manifest(dst, bundle_id="h200-perf-sweep", milestone="h200-perf-sweep")
    (f,) = [f for f in audit_paths([dst]).findings if f.check == "sweep.report_mismatch"]
    assert f.file.endswith(REPORT_FILE) and f.field.startswith("line ")


def test_the_committed_sweep_audits_clean() -> None:
    root = EVIDENCE / "h200-perf-sweep"
    assert list(audit_paths([root]).findings) == []
    doc = json.loads((root / SWEEP_FILE).read_text())
    f = doc["figures"]
    assert (f["keys"], f["families"]) == (252, 12)
    assert f["arms"]["ok"] + f["arms"]["oor"] == sum(len(k["arms"]) for k in doc["keys"])
    assert f["geomean_best_speedup"] > 1.0
