"""The decode tuner with a fake backend, a real SQLite store, the dispatcher and the audit."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from mxdb.audit.checks import audit_bundle
from mxdb.decode_rule import DecodeCase, decide
from mxdb.dispatcher import Dispatcher, DispatchOptions
from mxdb.errors import UsageError
from mxdb.evidence.decode import model_doc, write_decode_bundle
from mxdb.models import Fingerprint
from mxdb.results import Correctness, Timing
from mxdb.shapes import OpShape
from mxdb.store import Store
from mxdb.tune.decode import tune_decode

FP = Fingerprint(vendor="nvidia", device_name="FakeGPU", triton="3.6.0", torch="2.11", mxdb="0.1")

#: median microseconds of each impl per op (fused wins norms, torch wins rope, flaggems wrong
#: for swiglu, fused within noise for masked_softmax)
COST = {
    "rms_norm": {"torch": 20.0, "fused": 5.0, "flaggems": 7.0},
    "add_rms_norm": {"torch": 30.0, "fused": 6.0, "flaggems": 8.0},
    "rope": {"torch": 10.0, "fused": 12.0, "flaggems": 11.0},
    "masked_softmax": {"torch": 10.0, "fused": 9.95, "flaggems": 11.0},
    "swiglu": {"torch": 15.0, "fused": 6.0, "flaggems": 4.0},
}


class FakeDecodeBackend:
    name = "fake-decode"

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def fingerprint(self) -> Fingerprint:
        return FP

    def impls(self, op: str) -> list[str]:
        return ["torch", "fused", "flaggems"]

    def time(self, case: DecodeCase, impls: Sequence[str], *, reps: int, seed: int) -> list[Timing]:
        out = []
        for pos, i in enumerate(impls):
            # a repeated impl (the control twin) runs 1% slower: a 1% noise band
            skew = 1.01 if i in impls[:pos] else 1.0
            jitter = [1 + 0.001 * self.rng.random() for _ in range(reps)]
            out.append(Timing("ok", tuple(COST[case.op][i] * skew * j for j in jitter), None))
        return out

    def check(self, case: DecodeCase, impl: str, *, seed: int) -> Correctness:
        wrong = case.op == "swiglu" and impl == "flaggems"
        err = 0.5 if wrong else 1e-3
        return Correctness(err, err, 1e-2, 1e-2, not wrong)


CASES = [
    DecodeCase("rms_norm", {"n": 1024}, 8, "bf16"),
    DecodeCase("add_rms_norm", {"n": 1024}, 8, "bf16"),
    DecodeCase("rope", {"hq": 16, "hk": 8, "d": 128}, 8, "bf16"),
    DecodeCase("masked_softmax", {"h": 16, "k": 256}, 8, "bf16"),
    DecodeCase("swiglu", {"n": 3072}, 8, "bf16"),
]


@pytest.fixture()
def tuned(tmp_path: Path) -> tuple[Store, list, Path]:
    store = Store.open(f"sqlite:///{tmp_path / 'store.sqlite'}")
    bundle = tmp_path / "bundle"
    results = tune_decode(FakeDecodeBackend(), CASES, store, reps=20, evidence_dir=bundle)
    yield store, results, bundle
    store.close()


def test_winners_follow_the_rule(tuned: tuple[Store, list, Path]) -> None:
    _, results, _ = tuned
    winners = {r.case.op: r.winner for r in results}
    assert winners == {
        "rms_norm": "fused",
        "add_rms_norm": "fused",
        "rope": "torch",  # every candidate is slower than torch
        "masked_softmax": "torch",  # fused is 0.5% faster: within the 1% noise band
        "swiglu": "fused",  # flaggems is faster but wrong
    }
    soft = next(r for r in results if r.case.op == "masked_softmax")
    assert soft.noise_band == pytest.approx(0.01, abs=0.002)
    assert soft.speedup == 1.0 and soft.reason.startswith("best fused")
    rms = next(r for r in results if r.case.op == "rms_norm")
    assert rms.speedup == pytest.approx(4.0, rel=0.01)


def test_entries_and_measurements_stored(tuned: tuple[Store, list, Path]) -> None:
    store, _, bundle = tuned
    entries = store.entries(status="verified")
    assert {e.op for e in entries} == {c.op for c in CASES}
    for e in entries:
        assert e.fingerprint_hash == FP.hash and e.source == "tune"
        assert set(e.config) == {"impl"} and e.evidence == bundle.name
    ms = store.measurements(op="swiglu")
    roles = sorted((m.config["impl"], m.role, m.status) for m in ms)
    assert ("flaggems", "candidate", "wrong") in roles
    assert ("torch", "control", "ok") in roles


def test_dispatcher_answers_per_shape(tuned: tuple[Store, list, Path]) -> None:
    store, _, _ = tuned
    d = Dispatcher(store, FP, DispatchOptions(refresh_interval=0))
    dec = d.dispatch(OpShape("rms_norm", {"n": 1024}, 8, "bf16"), None)
    assert dec.config["impl"] == "fused" and dec.level == "exact"
    # neighbour token count within a factor 2
    assert d.dispatch(OpShape("rms_norm", {"n": 1024}, 12, "bf16"), None).config["impl"] == "fused"
    # another width: no entry -> fallback (the module's original code)
    far = d.dispatch(OpShape("rms_norm", {"n": 2048}, 8, "bf16"), None)
    assert far.config is None and far.reason == "no_entry"
    # another environment: fingerprint mismatch
    other = Fingerprint(vendor="nvidia", device_name="OtherGPU", mxdb="0.1")
    d2 = Dispatcher(store, other)
    assert (
        d2.dispatch(OpShape("rms_norm", {"n": 1024}, 8, "bf16"), None).reason
        == "fingerprint_mismatch"
    )
    # staleness: marking the entries stale makes the dispatcher fall back
    ids = [e.id for e in store.entries(op="rms_norm")]
    store.set_status(ids, "stale", reason="triton changed")
    d.refresh()
    assert d.dispatch(OpShape("rms_norm", {"n": 1024}, 8, "bf16"), None).reason == "stale"


def test_bundle_audits_clean_and_catches_edits(tuned: tuple[Store, list, Path]) -> None:
    _, _, bundle = tuned
    assert audit_bundle(bundle).findings == ()
    doc = json.loads((bundle / "decode.json").read_text())
    doc["cases"][0]["claims"]["speedup"] = 9.0
    (bundle / "decode.json").write_text(json.dumps(doc))
    checks = {f.check for f in audit_bundle(bundle).findings}
    assert "manifest.changed" in checks and "decode.claim_mismatch" in checks


def test_model_claims_recomputed(tmp_path: Path) -> None:
    variants = [
        {
            "name": "stock",
            "ops": [],
            "step_s": [0.02, 0.021, 0.019],
            "launches": 9000,
            "profiled_steps": 10,
            "max_abs_logit_diff": None,
        },
        {
            "name": "all",
            "ops": ["rms_norm"],
            "step_s": [0.012, 0.0125, 0.0119],
            "launches": 4000,
            "profiled_steps": 10,
            "max_abs_logit_diff": 0.01,
        },
    ]
    m = model_doc(
        name="qwen3-0.6b-random",
        config={"hidden_size": 1024, "moe": False},
        dtype="bf16",
        batch=8,
        prompt_len=16,
        variants=variants,
    )
    assert m["claims"]["all"]["speedup"] == pytest.approx(0.02 / 0.012)
    assert m["claims"]["all"]["launch_ratio"] == pytest.approx(4000 / 9000)
    assert m["meets_target"] is True
    root = write_decode_bundle(
        tmp_path / "b", fingerprint=FP, milestone="decode-bench", cases=[], models=[m]
    )
    assert audit_bundle(root).findings == ()
    m["claims"]["all"]["launches_per_token"] = 100.0
    m["meets_target"] = False
    root2 = write_decode_bundle(
        tmp_path / "b2", fingerprint=FP, milestone="decode-bench", cases=[], models=[m]
    )
    checks = sorted({f.check for f in audit_bundle(root2).findings})
    assert checks == ["decode.claim_mismatch", "decode.target_mismatch"]


def test_decide_without_control_keeps_torch() -> None:
    from mxdb.decode_rule import Candidate

    cands = [
        Candidate("torch", "baseline", "ok", (10.0,), 0.0, 0.0),
        Candidate("fused", "candidate", "ok", (1.0,), 0.0, 0.0),
    ]
    assert decide("bf16", cands)[0] == "torch"


def test_case_validation() -> None:
    with pytest.raises(UsageError, match="needs dims"):
        DecodeCase("rope", {"n": 4}, 1)
    with pytest.raises(UsageError, match="unknown"):
        DecodeCase("gelu", {"n": 4}, 1)
