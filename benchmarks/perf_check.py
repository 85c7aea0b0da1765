"""The learned model's answers for families it never saw, timed side by side on held-out routing.

Usage (anywhere):  python benchmarks/perf_check.py plan MODEL_BUNDLE SWEEP_BUNDLE PLAN.json
Usage (GPU host):  python benchmarks/perf_check.py run PLAN.json OUT.json [--deadline-s S]
                   [--seed-tag TAG]
Usage (anywhere):  python benchmarks/perf_check.py publish PLAN.json OUT.json MODEL_BUNDLE
                   SWEEP_BUNDLE evidence/h200-perf-check

``plan`` asks, for every family of the model's sweeps, the model trained *without* that family
(``mxdb.costmodel.train.lofo_plan``) for its choice at every token count of the sweep and every
routing class, with the confidence of the calibration fitted on the other families and whether
the gate answers it.  ``run`` times, at each family, token count and routing source (uniform,
Zipf(1.2), a hot expert), three routing instances from a generator neither the sweep nor the
tuner uses (``mxdb.routing_gen`` kind ``logits``, seeds of their own; ``--seed-tag`` draws
another set, so that a check of a model chosen after an earlier check times routing that check
never saw): each instance takes the
plan's choice for the class it falls in, timed against FlagGems' own choice three times
(baseline and two controls), 8 rounds in a random order per round, CUDA-graph replay, every
output checked against the float32 reference.  A choice the gate does not answer is timed too:
what it measures is what the confidence stated for it is checked against.  ``publish`` writes
the bundle (``mxdb.perf-check``), every figure recomputed by ``mxdb audit``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from mxdb.fileio import atomic_write_text

TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
#: routing source -> parameters of ``mxdb.routing_gen`` kind ``logits``
HELDOUT: dict[str, dict[str, Any]] = {
    "uniform": {},
    "zipf": {"s": 1.2},
    "hot": {"hot_bias": 1.5, "hot_expert": 0},
}
INSTANCES = 3
ROUNDS = 8
COPIES = 3


def instance_seed(family: str, tokens: int, source: str, instance: int, tag: str = "") -> int:
    import hashlib

    text = f"perf-check|{family}|{tokens}|{source}|{instance}" + (f"|{tag}" if tag else "")
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")


def plan(model_bundle: Path, sweep_bundle: Path, out: Path) -> None:
    from mxdb.costmodel.train import lofo_plan
    from mxdb.fileio import load_json

    model = load_json(model_bundle / "model.json", what="model")
    sweep = load_json(sweep_bundle / "sweep.json", what="sweep")
    entries = lofo_plan(sweep["keys"], model["training"], TOKENS)
    shapes = {k["family"]: k["shape"] for k in sweep["keys"]}
    atomic_write_text(out, json.dumps({"entries": entries, "shapes": shapes}))


def run(a: argparse.Namespace) -> None:
    import numpy as np
    import torch
    from mxdb.kernels.backend import GpuBackend

    from mxdb.configs import KernelConfig
    from mxdb.costmodel.menu import family_seed
    from mxdb.routing import expert_counts, trace_hash
    from mxdb.routing_gen import generate
    from mxdb.shapes import MoEShape
    from mxdb.tune.traces import classify

    t0 = time.monotonic()
    p = json.loads(Path(a.plan).read_text())
    table = {(e["family"], e["tokens"], e["routing_class"]): e for e in p["entries"]}
    backend = GpuBackend()
    doc: dict[str, Any] = {
        "fingerprint": backend.fingerprint().components(), "points": [], "errors": []
    }  # fmt: skip
    for fam, sd in p["shapes"].items():
        fam_shape = MoEShape.from_dict(sd)
        wseed = family_seed(fam_shape.family) % 100_000 + 7
        for m in TOKENS:
            if time.monotonic() - t0 > a.deadline_s:
                doc["errors"].append(f"{fam}: M={m} and later not timed (deadline)")
                break
            shape = fam_shape.with_tokens(m)
            base = backend.baseline_config(shape)
            planned = [table[(fam, m, c)]["config"] for c in ("uniform", "skewed", "hot", "sparse")]
            cfgs = [KernelConfig.model_validate(c) for c in planned if c is not None]
            backend.compile(shape, [base, *cfgs])
            backend.calls_per_sample = 8 if m <= 64 else 4 if m <= 256 else 2
            for source, params in HELDOUT.items():
                for i in range(INSTANCES):
                    seed = instance_seed(fam, m, source, i, a.seed_tag)
                    ids = generate("logits", m, shape.experts, shape.topk, seed, **params)
                    cls = classify(ids, shape.experts)
                    entry = table[(fam, m, cls)]
                    arms = [base] * COPIES
                    if entry["config"] is not None:
                        arms.append(KernelConfig.model_validate(entry["config"]))
                    ts = backend.time(shape, ids, arms, reps=ROUNDS, seed=wseed, order_seed=seed)
                    doc["points"].append({
                        "family": fam, "shape": shape.to_dict(), "tokens": m, "source": source,
                        "instance": i,
                        "routing": {"kind": "logits", "params": params, "seed": seed},
                        "trace_hash": trace_hash(ids, shape.experts),
                        "counts": [int(x) for x in expert_counts(np.asarray(ids), shape.experts)],
                        "routing_class": cls, "baseline": base.model_dump(),
                        "calls_per_sample": backend.calls_per_sample,
                        "arms": [{"config": c.model_dump(),
                                  "role": ("baseline" if j == 0 else "control" if j < COPIES
                                           else "candidate"),
                                  "status": t.status, "samples": list(t.samples_us),
                                  "error": t.error} for j, (c, t) in enumerate(zip(arms, ts,
                                                                                   strict=True))],
                    })  # fmt: skip
                    meds = [float(np.median(t.samples_us)) if t.samples_us else float("nan")
                            for t in ts]  # fmt: skip
                    print(f"{fam} M={m} {source}#{i} ({cls}, answered {entry['answered']}): "
                          f"{' '.join(f'{x:.1f}' for x in meds)} us at "
                          f"{time.monotonic() - t0:.0f}s", flush=True)  # fmt: skip
            atomic_write_text(a.out, json.dumps(doc))
        backend._weights = None
        backend._weights_key = None
        backend._acts.clear()
        torch.cuda.empty_cache()
    backend.close()
    atomic_write_text(a.out, json.dumps(doc))


def publish(plan_path: Path, raw_path: Path, model_bundle: Path, sweep_bundle: Path,
            bundle: Path) -> Path:  # fmt: skip
    """Write the check bundle from the plan and the raw JSON (every figure computed by mxdb)."""
    from mxdb.evidence.perfcheck import CHECK_FILE, REPORT_FILE, CheckDoc, build_check, render
    from mxdb.evidence.writer import publish_bundle
    from mxdb.fileio import load_json
    from mxdb.fingerprint import recorded_fingerprint

    p = json.loads(plan_path.read_text())
    raw = json.loads(raw_path.read_text())
    fp = recorded_fingerprint(raw["fingerprint"])
    doc = build_check(
        raw["points"],
        plan=p["entries"],
        model=load_json(model_bundle / "model.json", what="model"),
        model_bundle=model_bundle,
        sweep_bundle=sweep_bundle,
        milestone=bundle.name,
        fingerprint_hash=fp.hash,
        errors=raw.get("errors", []),
    )
    doc = CheckDoc.model_validate(doc).to_json_dict()
    return publish_bundle(
        bundle,
        fingerprint=fp,
        files={CHECK_FILE: doc, REPORT_FILE: render(doc)},
        milestone=bundle.name,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser("plan", help="the leave-one-family-out answers to time (CPU)")
    pl.add_argument("model_bundle", type=Path)
    pl.add_argument("sweep_bundle", type=Path)
    pl.add_argument("out", type=Path)
    r = sub.add_parser("run", help="time the plan's answers on held-out routing (GPU)")
    r.add_argument("plan", type=Path)
    r.add_argument("out", type=Path)
    r.add_argument("--deadline-s", type=float, default=520.0)
    r.add_argument("--seed-tag", default="", help="draw other routing instances (default: none)")
    p = sub.add_parser("publish", help="write the evidence bundle")
    for name in ("plan", "raw", "model_bundle", "sweep_bundle", "bundle"):
        p.add_argument(name, type=Path)
    a = ap.parse_args()
    if a.cmd == "plan":
        plan(a.model_bundle, a.sweep_bundle, a.out)
    elif a.cmd == "run":
        run(a)
    else:
        print(publish(a.plan, a.raw, a.model_bundle, a.sweep_bundle, a.bundle))


if __name__ == "__main__":
    main()
