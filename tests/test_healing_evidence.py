"""Self-healing evidence: raw stream -> document -> bundle -> audit, and tampering caught.

The raw output is simulated on the CPU the way ``benchmarks/self_healing.py run`` records it:
the real ``Healer`` decides which candidate each sampled call runs, every call costs its
candidate's virtual time (config A 10x slower in the slowed phase) and batches add them up.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest

from mxdb.audit.checks import audit_bundle
from mxdb.configs import GemmConfig, KernelConfig
from mxdb.decision import EXACT, Decision
from mxdb.errors import EvidenceError
from mxdb.evidence.healing import (
    HEALING_FILE,
    build_document,
    healing_figures,
    write_healing_bundle,
)
from mxdb.evidence.writer import write_manifest
from mxdb.models import Fingerprint
from mxdb.runtime.healing import Healer, HealingOptions

ROOT = Path(__file__).resolve().parent.parent
FP = Fingerprint(vendor="nvidia", device_name="NVIDIA H200", arch="sm_90", mxdb="0.1.0")
CFG_A = KernelConfig.uniform(
    GemmConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
)
CFG_B = KernelConfig.uniform(
    GemmConfig(block_m=16, block_n=128, block_k=64, num_warps=4, num_stages=3)
)
KEY = ("shape", "uniform")


def _decision(cfg: KernelConfig, entry_id: int) -> Decision:
    return Decision(
        config=cfg, level=EXACT, confidence=1.0, reason="exact_match", entry_id=entry_id
    )


class _TransitionLog:
    """The benchmark's on_change wrapper: each switch with the call index it was decided at."""

    def __init__(self, out: list[dict[str, Any]], call: list[int]) -> None:
        self.out, self.call = out, call
        self.healer: Healer | None = None

    def __call__(self, key: Any, decision: Any, is_original: bool) -> None:
        assert self.healer is not None
        t = self.healer.transitions[-1]
        self.out.append(
            {"call": self.call[0], "kind": t.kind, "from": t.from_index, "to": t.to_index,
             "ratio": t.ratio}
        )  # fmt: skip


def simulate_raw(
    *, calls: int = 600, batch: int = 20, every: int = 16, a_us: float = 500.0,
    b_us: float = 560.0, slowdown: float = 10.0, heal: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """A raw.json as the GPU run writes it, from a simulated stream driven by the real Healer."""
    opts = HealingOptions(sample_every=every)
    base = (a_us, b_us)
    streams = []
    for mode in ("static", "healing"):
        n = [0]
        transitions: list[dict[str, Any]] = []
        healer: Healer | None = None
        if mode == "healing" and heal:
            healer = Healer(opts, on_change=_TransitionLog(transitions, n))
            cast(_TransitionLog, healer.on_change).healer = healer
            healer.track(KEY, [_decision(CFG_A, 1), _decision(CFG_B, 2)], [a_us, b_us])
        count = 0
        phases = []
        n[0] = batch  # warm-up calls before the first phase
        for name, slowed in (("normal", False), ("slowed", True), ("recovered", False)):
            first, batches, launches = n[0] + 1, [], 0
            for start in range(0, calls, batch):
                size = min(batch, calls - start)
                t = 0.0
                for _ in range(size):
                    n[0] += 1
                    count += 1
                    idx = healer.active(KEY) if healer else 0
                    sampled = healer is not None and count % every == 0
                    if sampled:
                        assert healer is not None
                        idx, _d = healer.plan(KEY)
                    us = base[idx] * (slowdown if slowed and idx == 0 else 1.0)
                    us *= 1.0 + 0.01 * ((n[0] * 7919) % 11 - 5) / 5  # +-1% deterministic noise
                    launches += 2 if slowed and idx == 0 else 0
                    if sampled:
                        assert healer is not None
                        healer.record(KEY, idx, us)
                    t += us
                batches.append(
                    {"calls": size, "gpu_us": t, "active": healer.active(KEY) if healer else 0}
                )
            phases.append({"name": name, "slowed": slowed, "first_call": first,
                           "slowed_launches": launches, "host_wall_s": 0.1, "batches": batches})  # fmt: skip
        streams.append(
            {
                "mode": mode,
                "phases": phases,
                "transitions": transitions,
                "counters": {"calls": n[0]},
            }
        )
    cal = []
    for label, cfg, us in (("A", CFG_A, a_us), ("B", CFG_B, b_us)):
        samples = [us * (1 + 0.002 * (i % 5)) for i in range(40)]
        s = sorted(samples)
        cal.append({"label": label, "config": cfg.model_dump(), "config_hash": cfg.hash,
                    "samples_us": samples, "median_us": (s[19] + s[20]) / 2})  # fmt: skip
    overhead = {
        "shape": {"op": "fused_moe", "dtype": "bf16", "experts": 8, "hidden": 1024,
                  "intermediate": 1024, "topk": 2, "tokens": 16},
        "calls_per_rep": 4096, "warm_reps": 1,
        "modes": [
            {"mode": m, "sample_every": e, "us_per_call": [v, v * 1.01, v * 0.99],
             "samples_in_window": [0 if e is None else 4096 // e] * 3}
            for m, e, v in (("unhooked", None, 120.0), ("hooked", None, 124.0),
                            ("every_4096", 4096, 124.1), ("every_64", 64, 124.6),
                            ("every_4", 4, 131.0))
        ],
    }  # fmt: skip
    return {
        "status": "complete",
        "errors": [],
        "fingerprint": FP.model_dump(mode="json"),
        "setup": {
            "shape": {
                "op": "fused_moe",
                "dtype": "bf16",
                "experts": 8,
                "hidden": 4096,
                "intermediate": 14336,
                "topk": 2,
                "tokens": 64,
            },
            "slowdown": slowdown,
            "calls_per_phase": calls,
            "batch_calls": batch,
            "healing_options": {"sample_every": every},
            "candidates": ["A", "B"],
            "timing": "simulated",
        },
        "calibration": cal,
        "streams": streams,
        "overhead": overhead,
    }


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    return simulate_raw()


def _bundle(tmp_path: Path, raw: dict[str, Any], name: str = "b") -> Path:
    return write_healing_bundle(tmp_path / name, build_document(raw), bundle_id="heal-test")


def _checks(root: Path) -> set[str]:
    return {f.check for f in audit_bundle(root).findings}


def _edit(root: Path, fn: Any) -> None:
    """Edit self_healing.json and re-seal the manifest: only the semantic checks can object."""
    path = root / HEALING_FILE
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc, sort_keys=True, indent=1) + "\n")
    write_manifest(root, bundle_id="heal-test", milestone=doc["milestone"])


def test_simulated_run_heals_and_its_bundle_passes_audit(
    tmp_path: Path, raw: dict[str, Any]
) -> None:
    doc = build_document(raw)
    c = doc.claims
    assert c.demoted_while_slowed and c.recovered_after_lift and c.met
    assert c.false_switches == 0
    slowed = doc.streams[1].phases[1]
    assert c.switch_call is not None and slowed.first_call < c.switch_call < slowed.first_call + 200
    assert c.recover_call is not None and c.recover_call > doc.streams[1].phases[2].first_call
    # static pays 10x while slowed; healing pays 10x until it switches, then runs B (560 us)
    assert 3.0 < c.ratio["slowed"] < 10.0
    assert 0.9 < c.ratio["normal"] < 1.1
    assert [t.kind for t in doc.streams[1].transitions] == ["demote", "recover"]
    assert c.overhead["every_4"].overhead_us == pytest.approx(7.0)
    assert c.overhead["hooked"].overhead_us == 0.0
    root = _bundle(tmp_path, raw)
    assert audit_bundle(root).findings == ()
    assert sorted(p.name for p in root.iterdir()) == [
        "fingerprint.json", "manifest.json", "self_healing.json"
    ]  # fmt: skip


def test_no_healing_is_an_honest_unmet_claim(tmp_path: Path) -> None:
    raw = simulate_raw(heal=False)
    doc = build_document(raw)
    assert not doc.claims.met and doc.claims.switch_call is None
    assert doc.claims.ratio["slowed"] == pytest.approx(1.0, rel=0.05)
    assert audit_bundle(_bundle(tmp_path, raw)).findings == ()


@pytest.mark.parametrize(
    ("edit", "check"),
    [
        (lambda d: d["claims"]["ratio"].__setitem__("slowed", 9.9), "healing.ratio_mismatch"),
        (
            lambda d: d["claims"]["throughput"]["static"]["slowed"].__setitem__("calls_per_s", 1e6),
            "healing.throughput_mismatch",
        ),
        (
            lambda d: d["streams"][0]["phases"][1]["batches"][3].__setitem__("gpu_us", 100.0),
            "healing.throughput_mismatch",
        ),
        (lambda d: d["claims"].__setitem__("switch_call", 5), "healing.transition_mismatch"),
        (
            lambda d: d["streams"][1]["transitions"][0].__setitem__(
                "call", d["streams"][1]["transitions"][0]["call"] + 100
            ),
            "healing.transition_mismatch",
        ),
        (
            lambda d: d["streams"][1]["phases"][1]["batches"][-1].__setitem__("active", 0),
            "healing.transition_mismatch",
        ),
        (
            lambda d: d["claims"].__setitem__("recovered_after_lift", False),
            "healing.claim_mismatch",
        ),
        (
            lambda d: d["overhead"]["modes"][4]["us_per_call"].__setitem__(0, 500.0),
            "healing.overhead_mismatch",
        ),
        (
            lambda d: d["calibration"][0].__setitem__("median_us", 1.0),
            "healing.calibration_mismatch",
        ),
        (
            lambda d: d["calibration"][1].__setitem__("config_hash", "0" * 16),
            "healing.config_mismatch",
        ),
        (lambda d: d.__setitem__("fingerprint_hash", "0" * 16), "healing.fingerprint_mismatch"),
        (
            lambda d: d["streams"][0]["phases"][0].__setitem__("slowed_launches", 7),
            "healing.injection_mismatch",
        ),
        (lambda d: d["streams"][0]["phases"][2]["batches"].pop(), "healing.stream_invalid"),
        (lambda d: d["streams"][1]["phases"].reverse(), "healing.stream_invalid"),
        (lambda d: d.__setitem__("schema_version", "9.9"), "schema.unknown_version"),
        (lambda d: d["claims"].pop("met"), "schema.invalid"),
    ],
)
def test_tampering_is_found(tmp_path: Path, raw: dict[str, Any], edit: Any, check: str) -> None:
    root = _bundle(tmp_path, raw)
    _edit(root, edit)
    assert check in _checks(root)


def test_claim_of_success_without_recovery_is_found(tmp_path: Path) -> None:
    raw = simulate_raw(heal=False)
    root = _bundle(tmp_path, raw)

    def claim_success(d: dict[str, Any]) -> None:
        d["claims"].update(met=True, demoted_while_slowed=True, recovered_after_lift=True)

    _edit(root, claim_success)
    findings = [f for f in audit_bundle(root).findings if f.check == "healing.claim_mismatch"]
    assert {f.field for f in findings} == {
        "claims.met", "claims.demoted_while_slowed", "claims.recovered_after_lift"
    }  # fmt: skip


def test_unsealed_edit_is_a_manifest_change(tmp_path: Path, raw: dict[str, Any]) -> None:
    root = _bundle(tmp_path, raw)
    path = root / HEALING_FILE
    path.write_text(path.read_text().replace('"met": true', '"met": false'))
    assert "manifest.changed" in _checks(root)


def test_figures_are_recomputed_from_batches(raw: dict[str, Any]) -> None:
    fig = healing_figures(raw)
    ph = raw["streams"][0]["phases"][1]
    calls = sum(b["calls"] for b in ph["batches"])
    gpu_s = sum(b["gpu_us"] for b in ph["batches"]) / 1e6
    assert fig["throughput"]["static"]["slowed"]["calls_per_s"] == calls / gpu_s


def test_incomplete_raw_is_refused(raw: dict[str, Any]) -> None:
    partial = {**raw, "streams": raw["streams"][:1]}
    with pytest.raises(EvidenceError, match="streams"):
        build_document(partial)


def test_writer_refuses_a_non_empty_directory(tmp_path: Path, raw: dict[str, Any]) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f").write_text("")
    with pytest.raises(EvidenceError, match="not an empty directory"):
        write_healing_bundle(tmp_path / "x", build_document(raw))


def test_script_help_and_publish_on_cpu(tmp_path: Path, raw: dict[str, Any]) -> None:
    script = str(ROOT / "benchmarks" / "self_healing.py")
    for args in ([], ["run"], ["publish"]):
        out = subprocess.run(
            [sys.executable, script, *args, "--help"], capture_output=True, text=True, check=True
        )
        assert "usage" in out.stdout
    rawfile = tmp_path / "raw.json"
    rawfile.write_text(json.dumps(raw))
    out = subprocess.run(
        [sys.executable, script, "publish", str(rawfile), str(tmp_path / "bundle")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert '"met": true' in out.stdout
    audit = subprocess.run(
        [sys.executable, "-m", "mxdb", "audit", str(tmp_path / "bundle")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert audit.returncode == 0, audit.stdout + audit.stderr
