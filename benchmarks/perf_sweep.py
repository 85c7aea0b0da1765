"""Training data for the learned performance model: the menu of configs timed at many keys.

Usage (GPU host): python benchmarks/perf_sweep.py run OUT.json [--families a,b,...]
                  [--tokens 1,4,...] [--deadline-s S] [--resume EARLIER.json]
Usage (anywhere): python benchmarks/perf_sweep.py publish OUT.json [MORE.json ...]
                  evidence/h200-perf-sweep

For each model family (``mxdb.shapes.PRESETS``, bf16), token count and routing source
(uniform, Zipf(1.2), half the tokens to one hot expert; ``mxdb.routing_gen``, seeded per key),
every config of the model's menu (``mxdb.costmodel.menu.menu``: FlagGems' kernels on 13 tiles,
``fused_act`` on 5, ``fused_slice`` on 6 where the batch is small enough) and 6 configs of
vLLM's grid drawn per family (``menu.extras``) are checked against the float32 reference and
timed by CUDA-graph replay with FlagGems' own choice three times (the baseline and two
controls), 7 rounds in a random order per round.  Configs the resource proxy rejects, that fail
to compile or that compute a wrong result stay in the record with their status.

``publish`` writes the bundle: ``fingerprint.json``, ``sweep.json`` (``mxdb.perf-sweep``: raw
samples, routing counts and every figure, recomputed by ``mxdb audit``) and ``report/sweep.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from mxdb.fileio import atomic_write_text

#: The families swept: every preset of ``mxdb.shapes.PRESETS`` but Llama-4-Maverick and
#: DeepSeek-V2, whose weights alone take 32 and 7.5 GB a call at full size.
FAMILIES = (
    "mixtral-8x7b", "mixtral-8x22b", "qwen3-30b-a3b", "qwen3-235b-a22b", "qwen1.5-moe-a2.7b",
    "qwen2-57b-a14b", "deepseek-v2-lite", "deepseek-v3", "llama-4-scout", "olmoe-1b-7b",
    "gpt-oss-20b", "gpt-oss-120b",
)  # fmt: skip
TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
#: routing source -> (mxdb.routing_gen kind, parameters)
ROUTINGS: dict[str, tuple[str, dict[str, Any]]] = {
    "uniform": ("uniform", {}),
    "zipf1.2": ("zipf", {"s": 1.2}),
    "hot0.5": ("hot", {"fraction": 0.5, "hot_expert": 0}),
}
ROUNDS = 7
COPIES = 3


def key_seed(family: str, tokens: int, source: str) -> int:
    import hashlib

    text = f"perf-sweep|{family}|{tokens}|{source}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")


def calls_per_sample(tokens: int) -> int:
    return 8 if tokens <= 64 else 4 if tokens <= 256 else 2


def run(a: argparse.Namespace) -> None:
    import numpy as np
    import torch
    from mxdb.kernels.backend import GpuBackend

    from mxdb.costmodel.menu import extras, family_seed, menu
    from mxdb.resources import check, flaggems_default_config
    from mxdb.routing import expert_counts, trace_hash
    from mxdb.routing_gen import generate
    from mxdb.shapes import preset_shape
    from mxdb.tune.traces import classify

    t0 = time.monotonic()
    backend = GpuBackend()
    doc: dict[str, Any] = {
        "fingerprint": backend.fingerprint().components(), "keys": [], "errors": []
    }  # fmt: skip
    if a.resume:
        doc = json.loads(Path(a.resume).read_text())
    done = {(k["family"], k["tokens"], k["source"]) for k in doc["keys"]}
    profile = backend.profile()
    families = a.families.split(",") if a.families else list(FAMILIES)
    tokens = [int(x) for x in a.tokens.split(",")] if a.tokens else list(TOKENS)
    stop = False
    for fam_name in families:
        if stop:
            break
        fam = preset_shape(fam_name, 1, "bf16")
        wseed = family_seed(fam.family) % 100_000
        for m in tokens:
            shape = fam.with_tokens(m)
            todo = [s for s in ROUTINGS if (fam_name, m, s) not in done]
            if not todo:
                continue
            if time.monotonic() - t0 > a.deadline_s:
                doc["errors"].append(f"{fam_name}: M={m} and later not timed (deadline)")
                stop = True
                break
            base = backend.baseline_config(shape)
            cands = [*menu(shape), *extras(shape, profile=profile)]
            arms_meta: list[dict[str, Any]] = []
            fits = []
            for c in cands:
                r = check(c, shape, profile)
                if r.fits:
                    fits.append(c)
                else:
                    why = "; ".join(x for g in (r.gemm1, r.gemm2) for x in g.reasons)
                    arms_meta.append({"config": c.model_dump(), "role": "candidate",
                                      "status": "oor", "samples": [], "error": why})  # fmt: skip
            compiled = backend.compile(shape, [base, *fits])
            if compiled[0].status != "ok":
                doc["errors"].append(f"{fam_name} M={m}: FlagGems' choice failed to compile")
                continue
            ok = []
            for c, cr in zip(fits, compiled[1:], strict=True):
                if cr.status == "ok":
                    ok.append(c)
                else:
                    arms_meta.append({"config": c.model_dump(), "role": "candidate",
                                      "status": cr.status, "samples": [],
                                      "error": cr.error})  # fmt: skip
            backend.calls_per_sample = calls_per_sample(m)
            for source in todo:
                kind, params = ROUTINGS[source]
                seed = key_seed(fam_name, m, source)
                ids = generate(kind, m, shape.experts, shape.topk, seed, **params)
                arms = [base] * COPIES + ok
                timings = backend.time(shape, ids, arms, reps=ROUNDS, seed=wseed,
                                       order_seed=seed)  # fmt: skip
                recs = [dict(a_) for a_ in arms_meta]
                for j, (c, t) in enumerate(zip(arms, timings, strict=True)):
                    role = "baseline" if j == 0 else "control" if j < COPIES else "candidate"
                    recs.append({"config": c.model_dump(), "role": role, "status": t.status,
                                 "samples": list(t.samples_us), "error": t.error})  # fmt: skip
                counts = expert_counts(np.asarray(ids), shape.experts)
                doc["keys"].append({
                    "family": fam_name, "shape": shape.to_dict(), "tokens": m, "source": source,
                    "routing": {"kind": kind, "params": params, "seed": seed},
                    "trace_hash": trace_hash(ids, shape.experts),
                    "counts": [int(x) for x in counts],
                    "routing_class": classify(ids, shape.experts),
                    "baseline": base.model_dump(),
                    "baseline_restated": flaggems_default_config(shape).model_dump(),
                    "rounds": ROUNDS, "calls_per_sample": backend.calls_per_sample,
                    "arms": recs,
                })  # fmt: skip
                base_med = float(np.median(timings[0].samples_us)) if timings[0].samples_us else 0.0
                best = min((float(np.median(t.samples_us)) for t in timings[COPIES:] if t.samples_us),
                           default=float("nan"))  # fmt: skip
                print(f"{fam_name} M={m} {source}: FlagGems {base_med:.1f} us, best "
                      f"{best:.1f} us, {len(ok)} timed at {time.monotonic() - t0:.0f}s",
                      flush=True)  # fmt: skip
            a.out.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(a.out, json.dumps(doc))
        backend._weights = None
        backend._weights_key = None
        backend._acts.clear()
        torch.cuda.empty_cache()
    backend.close()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(a.out, json.dumps(doc))


def publish(raws: list[Path], bundle: Path) -> Path:
    """Write the sweep bundle from one or more raw JSON files of one host."""
    from mxdb.evidence.sweep import REPORT_FILE, SWEEP_FILE, SweepDoc, build_sweep, render
    from mxdb.evidence.writer import publish_bundle
    from mxdb.fingerprint import recorded_fingerprint

    docs = [json.loads(p.read_text()) for p in raws]
    fps = {recorded_fingerprint(d["fingerprint"]).hash for d in docs}
    if len(fps) != 1:
        raise SystemExit(f"the raw files come from {len(fps)} fingerprints: {sorted(fps)}")
    fp = recorded_fingerprint(docs[0]["fingerprint"])
    keys = [k for d in docs for k in d["keys"]]
    errors = [e for d in docs for e in d.get("errors", [])]
    doc = build_sweep(keys, milestone=bundle.name, fingerprint_hash=fp.hash, errors=errors)
    doc = SweepDoc.model_validate(doc).to_json_dict()
    return publish_bundle(
        bundle,
        fingerprint=fp,
        files={SWEEP_FILE: doc, REPORT_FILE: render(doc)},
        milestone=bundle.name,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="time the menu on this GPU (writes the raw JSON)")
    r.add_argument("out", type=Path)
    r.add_argument("--families", help="comma-separated presets (default: FAMILIES)")
    r.add_argument("--tokens", help="comma-separated token counts (default: TOKENS)")
    r.add_argument("--deadline-s", type=float, default=540.0)
    r.add_argument("--resume", help="an earlier raw file: its keys are kept and not timed again")
    p = sub.add_parser("publish", help="write the evidence bundle from the raw JSON files")
    p.add_argument("paths", type=Path, nargs="+", help="RAW.json [RAW.json ...] BUNDLE")
    a = ap.parse_args()
    if a.cmd == "run":
        run(a)
    else:
        if len(a.paths) < 2:
            ap.error("publish takes one or more raw files and the bundle folder")
        print(publish(a.paths[:-1], a.paths[-1]))


if __name__ == "__main__":
    main()
