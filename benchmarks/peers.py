"""Side by side on one GPU: FlagGems' config, vLLM's H200 table and mxdb's dispatch.

Usage (GPU host):  python benchmarks/peers.py run OUT.json --store-export EXPORT.json
                   [--workload examples/workloads/h200-peers.yaml]
                   [--deadline-s S] [--heldout [--instances K] [--salt S]
                   [--data-use test|development]]
Usage (anywhere):  python benchmarks/peers.py publish OUT.json evidence/h200-peers

``run``: for Mixtral-8x7B and Qwen3-30B-A3B (bf16), M in 1..4096 and uniform / Zipf / hot-expert
routing, times per point, interleaved in one process (A B C ... A B C ...):

(a) FlagGems 5.0.2's own config (``try_get_optimal_moe_config``);
(b) the incumbent: the row of vLLM 0.33.0's table for this device (``mxdb.incumbent``, shipped
    with mxdb), through the same kernel (nearest M, same config both GEMMs);
(c) the config mxdb dispatches from the tuned store (imported into a temporary store; the
    dispatcher uses the export's recorded fingerprint), for the point's routing class;
(d) mxdb's routing-oblivious choice (what it dispatches for uniform routing), when it differs;
a same-config control pair of (c).  GPU time = CUDA-graph replay of the whole layer.  Eager time =
back-to-back plain calls between events: FlagGems' ``fused_experts_impl`` for (a) against mxdb's
lean ``MoELayer`` for (c).  The memory-bound floor uses the device-to-device copy bandwidth
measured in the same run; the streaming-read bandwidth measured next to it gives the decode
floor fraction against reads alone too (``mxdb.peers`` 1.4).  Also the dispatch cost: ``mxdb`` dispatch hit against FlagGems'
``try_get_optimal_moe_config``.  The JSON is rewritten after every point.

Routing: with ``--workload`` (the tuning workload of the store, e.g.
``examples/workloads/h200-peers.yaml``) each point replays the trace that workload replayed when
it was tuned, so the class it dispatches with is the class the point was tuned under; without
it, the point's routing is generated here (seed = M).  With ``--heldout`` a point is a routing
distribution judged on K held-out instances (``--instances``, default 3): instance ``i`` is
drawn by ``mxdb.routing_gen`` kind ``logits`` with seed ``heldout_seed(preset, M, kind, i, salt)``
(the salt drawn fresh for each run unless ``--salt`` names one, and recorded)
(instance 0's seed is the one of the single-instance runs), classified and dispatched on its
own (class, reasons and configs recorded per instance), and timed in its own interleaved
rounds of random order (order seed = its seed; ``instance_reps`` rounds: about 1.6x one
instance's rounds pooled, never fewer than ``verdict.MIN_ROUNDS`` per instance).  The raw
point then holds ``instances``; ``publish`` writes ``mxdb.peers`` 1.4 (the 1.2 layout, judged
on the held-out targets, with the streaming-read floor; 1.3 from a raw output without a read
bandwidth), whose verdict per point pools the instances' rounds.  The dispatcher answers as the export's
fingerprint that equals this host's (else the export's first one), under the strict policy.

``publish``: writes the evidence bundle from OUT.json: runs with raw samples, summary, report, and
``peers.json`` (``mxdb.peers``: every figure above and each target with its threshold, measured
value and verdict, all recomputed by ``mxdb audit`` from the runs' samples).
"""

# ruff: noqa: B023  (the timed lambdas run before their loop variables change)
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from mxdb.fileio import atomic_write_text

FAMILIES = {"mixtral-8x7b": "E=8,N=14336", "qwen3-30b-a3b": "E=128,N=768"}
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
ROUTINGS = {"uniform": {}, "zipf": {"s": 1.2}, "hot": {"fraction": 0.5, "hot_expert": 0}}
#: Held-out routing (``--heldout``): the same three kinds from a generator the tuner never
#: uses (``mxdb.routing_gen`` kind ``logits``: top-k of random router logits with a bias).
HELDOUT = {"uniform": {}, "zipf": {"s": 1.2}, "hot": {"hot_bias": 1.5, "hot_expert": 0}}


def heldout_seed(preset: str, tokens: int, kind: str, instance: int = 0, salt: str = "") -> int:
    """The seed of held-out instance ``instance`` of one point, unrelated to the workload's.

    Instance 0's seed is the seed of the single-instance runs (schema 1.1): the index enters
    the hashed text only from instance 1 on, so instance 0 of a new run is the old instance.
    A ``salt`` (``--salt``; by default drawn fresh for each run and recorded) gives a new set
    of instances: test data drawn once, for one check.
    """
    import hashlib

    text = f"peers-heldout|{preset}|{tokens}|{kind}"
    if instance:
        text += f"|{instance}"
    if salt:
        text += f"|salt={salt}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")


#: Rounds and calls per sample of one interleaved comparison, for M < 512 and M >= 512, when
#: each point is timed on one routing instance.
REPS = {False: (15, 4), True: (7, 2)}


def instance_reps(tokens: int, instances: int) -> tuple[int, int]:
    """(rounds, calls per sample) of each of a point's ``instances`` held-out instances.

    One instance keeps today's (15, 4) below M = 512 and (7, 2) from there.  With K instances
    each gets ``max(verdict.MIN_ROUNDS, ceil(rounds * 1.6 / K))`` rounds (calls per sample
    unchanged): the pooled verdict then has about 1.6x the rounds of one instance (K = 3:
    8 rounds each below M = 512, 24 pooled; 6 each from M = 512, 18 pooled), and each
    instance on its own still has the sign test's minimum, so its own verdict is defined.
    """
    import math

    from mxdb.verdict import MIN_ROUNDS

    reps, cps = REPS[tokens >= 512]
    if instances <= 1:
        return reps, cps
    return max(MIN_ROUNDS, math.ceil(reps * 1.6 / instances)), cps


def atomic_json(path: Path, doc: Any) -> None:
    atomic_write_text(path, json.dumps(doc))


def incumbent_config(device_name: str, shape: Any) -> Any:
    """(b): the incumbent, what the user runs today on this device (``mxdb.incumbent``: the
    row of vLLM 0.33.0's table for the device at the nearest M, both GEMMs)."""
    from mxdb.incumbent import incumbent

    inc = incumbent(shape, device_name)
    if not inc.is_table_row:
        raise SystemExit(f"no vLLM table for {device_name} and {shape.family}: no incumbent row")
    return inc.config


def median_time_sample(samples: list[float]) -> float:
    """The bandwidth sample of the median time (of bytes per second samples of fixed bytes)."""
    # the slowest-first sample at the middle: the bandwidth of the median time
    return sorted(samples, reverse=True)[len(samples) // 2]


def bandwidth() -> float:
    """Device-to-device copy bandwidth (read + write bytes per second): the sample of the
    median time of 20."""
    from mxdb.kernels.timing import copy_bandwidth_samples

    return median_time_sample(copy_bandwidth_samples())


def read_bandwidth() -> float:
    """Streaming-read bandwidth (bytes read per second, a float32 sum over 2 GiB of bf16): the
    sample of the median time of 20."""
    from mxdb.kernels.timing import read_bandwidth_samples

    return median_time_sample(read_bandwidth_samples())


def dispatch_cost(dispatcher: Any, shape: Any) -> dict[str, float]:
    from mxdb.kernels.backend import flaggems_config

    dispatcher.dispatch(shape, "uniform")
    n = 200_000
    t0 = time.perf_counter_ns()
    for _ in range(n):
        dispatcher.dispatch(shape, "uniform")
    mx = (time.perf_counter_ns() - t0) / n / 1000
    flaggems_config(shape)
    n2 = 2000
    t0 = time.perf_counter_ns()
    for _ in range(n2):
        flaggems_config(shape)
    fg = (time.perf_counter_ns() - t0) / n2 / 1000
    return {"mxdb_dispatch_hit_us": mx, "flaggems_lookup_us": fg}


def dispatch_info(
    dispatcher: Any, shape: Any, ids: Any, device_name: str, seed: int
) -> dict[str, Any]:
    """One routing instance's class and the configs each arm runs for it: (a) FlagGems',
    (b) the incumbent (vLLM's row), and, with a dispatcher, (c) its answer for the instance's
    class and (d) its routing-oblivious answer (FlagGems' config where it falls back)."""
    from mxdb.kernels.layer import flaggems_kernel_config

    from mxdb.routing import classify, features

    rclass = classify(features(ids, shape.experts))
    cfgs: dict[str, Any] = {
        "a": flaggems_kernel_config(shape),
        "b": incumbent_config(device_name, shape),
    }
    reasons = {}
    answered: dict[str, Any] = {}
    if dispatcher is not None:
        dc = dispatcher.dispatch(shape, rclass)
        du = dispatcher.dispatch(shape, "uniform")
        reasons = {"c": dc.reason, "d": du.reason}
        answered = {
            n: {"entry_tokens": dd.tokens, "entry_routing_class": dd.routing_class}
            for n, dd in (("c", dc), ("d", du))
        }
        cfgs["c"] = dc.config if dc.config is not None else cfgs["a"]
        cfgs["d"] = du.config if du.config is not None else cfgs["a"]
    return {"cfgs": cfgs, "rclass": rclass, "reasons": reasons, "answered": answered, "seed": seed}


def workload_traces(path: str) -> dict[tuple[str, int, str], tuple[Any, int]]:
    """(family preset, M, routing kind) -> (replayed ids, seed) of a tuning workload's points.

    Each of this benchmark's routings must be in the workload with the same parameters, and
    each family among its models (bf16).
    """
    from mxdb.shapes import preset_shape
    from mxdb.tune.traces import point_traces
    from mxdb.tune.workload import HotRouting, ZipfRouting, load_workload

    wl = load_workload(path)

    def params(r: Any) -> dict[str, Any]:
        if isinstance(r, ZipfRouting):
            return {"s": r.exponent}
        if isinstance(r, HotRouting):
            return {"fraction": r.fraction, "hot_expert": r.expert}
        return {}

    kinds = {}
    for i, r in enumerate(wl.routings):
        for kind, want in ROUTINGS.items():
            if r.kind == kind and params(r) == want:
                kinds[kind] = i
    missing = sorted(set(ROUTINGS) - set(kinds))
    if missing:
        raise SystemExit(f"{path}: no routing matching {missing} with parameters {ROUTINGS}")
    out: dict[tuple[str, int, str], tuple[Any, int]] = {}
    for preset in FAMILIES:
        fam = preset_shape(preset, 1, "bf16")
        if not any(m.shape(1, "bf16").family == fam.family for m in wl.models):
            raise SystemExit(f"{path}: model {preset} ({fam.family}) is not in the workload")
        for m in TOKENS:
            for kind, ri in kinds.items():
                replay, _ = point_traces(wl, fam.with_tokens(m), ri)
                out[(preset, m, kind)] = (replay.ids, int(replay.generator["seed"]))
    return out


def run(a: argparse.Namespace) -> None:
    import flag_gems.fused.fused_moe as fm
    import numpy as np
    import torch
    from mxdb.kernels.backend import GpuBackend
    from mxdb.kernels.compile import specs_for
    from mxdb.kernels.layer import MoELayer
    from mxdb.kernels.pipeline import MoEPipeline
    from mxdb.kernels.reference import compare, make_activations, make_weights, moe_reference
    from mxdb.kernels.timing import time_interleaved

    from mxdb.dispatcher import Dispatcher, DispatchOptions
    from mxdb.interop.export import import_export, read_export
    from mxdb.routing_gen import generate
    from mxdb.shapes import family_shape
    from mxdb.store import Store

    t_start = time.monotonic()
    backend = GpuBackend()
    doc: dict[str, Any] = {
        "fingerprint": backend.fingerprint().components(),
        "seed_salt": a.salt if a.heldout else None,
        "data_use": a.data_use if a.heldout else None,
        "zero_shot": bool(a.zero_shot),
        "points": [],
        "errors": [],
    }
    doc["bandwidth_bytes_per_s"] = bandwidth()
    doc["read_bandwidth_bytes_per_s"] = read_bandwidth()
    dispatcher = None
    traces = workload_traces(a.workload) if a.workload and not a.heldout else None
    doc["trace_source"] = f"workload {a.workload}" if traces else "generated, seed = M"
    if a.heldout:
        doc["trace_source"] = (
            "held-out: mxdb.routing_gen kind logits (top-k of N(0,1) router logits plus a "
            "Zipf(1.2) bias for zipf, +1.5 on expert 0 for hot), seeds from "
            f"benchmarks/peers.py heldout_seed(preset, M, kind, i, salt={a.salt!r}) for "
            f"{a.instances} "
            "instances i per point, each timed in its own rounds and pooled by the verdict; "
            "the tuner never draws from this generator"
        )
        doc["rule"] = "verdict"
        doc["instances"] = a.instances
    if a.zero_shot:
        # families the store never measured: an empty store, the model answering as the
        # fingerprint it was trained under (its bundle's), else the incumbent
        from mxdb.fingerprint import load_fingerprint

        model_dir = Path(a.perf_model)
        fp = load_fingerprint(model_dir / "fingerprint.json")
        store = Store.open(f"sqlite:///{tempfile.mkdtemp()}/zero-shot.sqlite")
        doc["dispatch_fingerprint"] = fp.hash
        doc["dispatch_fingerprint_is_live"] = fp.hash == backend.fingerprint().hash
        doc["perf_model"] = str(model_dir)
        dispatcher = Dispatcher(
            store, fp, DispatchOptions(policy="strict", model=model_dir / "model.json")
        )
    elif a.store_export and Path(a.store_export).exists():
        exp = read_export(a.store_export)
        tmp = tempfile.mkdtemp()
        store = Store.open(f"sqlite:///{tmp}/peers.sqlite")
        doc["import"] = import_export(store, a.store_export)
        fps = list(exp.fingerprints.values())
        doc["store_fingerprints"] = [fp.components() for fp in fps]
        live = backend.fingerprint().hash
        fp_or_none = next((f for f in fps if f.hash == live), fps[0] if fps else None)
        doc["dispatch_fingerprint"] = fp_or_none.hash if fp_or_none is not None else None
        doc["dispatch_fingerprint_is_live"] = fp_or_none is not None and fp_or_none.hash == live
        dispatcher = Dispatcher(store, fp_or_none, DispatchOptions(policy="strict"))
    elif a.store_export:
        doc["errors"].append(f"store export {a.store_export} not found: (c) is FlagGems' choice")
    out = Path(a.out)
    atomic_json(out, doc)
    for preset in a.families:
        device_name = str(backend.fingerprint().device_name)
        fam = family_shape(preset, 1, "bf16")
        w1, w2 = make_weights(fam, 0, "cuda")
        if dispatcher is not None:
            doc.setdefault("dispatch_cost", {})[preset] = dispatch_cost(
                dispatcher, fam.with_tokens(4)
            )
        # per point: (M, routing kind, its instances: (ids, dispatch info) each)
        plan: list[tuple[int, str, list[tuple[Any, dict[str, Any]]]]] = []
        specs = []
        for m in TOKENS:
            shape = fam.with_tokens(m)
            for kind, params in ROUTINGS.items():
                drawn = []
                point_cfgs: dict[str, Any] = {}
                for i in range(a.instances if a.heldout else 1):
                    if a.heldout:
                        seed = heldout_seed(preset, m, kind, i, a.salt)
                        ids = generate(
                            "logits", m, fam.experts, fam.topk, seed=seed, **HELDOUT[kind]
                        )
                    elif traces is not None:
                        ids, seed = traces[(preset, m, kind)]
                    else:
                        ids, seed = generate(kind, m, fam.experts, fam.topk, seed=m, **params), m
                    info = dispatch_info(dispatcher, shape, ids, device_name, seed)
                    drawn.append((ids, info))
                    point_cfgs.update({c.hash: c for c in info["cfgs"].values()})
                for c in point_cfgs.values():
                    specs.extend(specs_for(shape, c))
                plan.append((m, kind, drawn))
        t0 = time.monotonic()
        backend.compile_raw(specs)
        doc.setdefault("compile_s", {})[preset] = time.monotonic() - t0
        layers: dict[str, Any] = {}

        def time_instance(m: int, ids_np: Any, info: dict[str, Any]) -> dict[str, Any]:
            """Time one routing instance: every arm in interleaved rounds (graph), and eager."""
            shape = fam.with_tokens(m)
            ids_t = torch.from_numpy(np.ascontiguousarray(ids_np, dtype=np.int32)).cuda()
            x, tw, ids = make_activations(shape, m, ids_t, "cuda")
            ref = moe_reference(x, w1, w2, tw, ids)
            cfgs = info["cfgs"]
            names = list(cfgs)
            if "d" in cfgs and cfgs["d"].hash == cfgs["c"].hash:
                names.remove("d")
            # same-config copies: of (a) under the verdict rule (its noise band), else of (c)
            copy = "a" if a.heldout else "c"
            builds = list(names) + (["ctl1", "ctl2"] if "c" in cfgs else [])
            if a.heldout:
                # buffers are placed in the order pipelines are built: a fixed order would give
                # one arm the same placement on every instance (a bias the pooled verdict no
                # longer averages away), so held-out runs build them in a seeded random order
                builds = [
                    builds[i] for i in np.random.default_rng(info["seed"]).permutation(len(builds))
                ]
            pipes: dict[str, Any] = {}
            for n in builds:
                cfg = cfgs[copy] if n in ("ctl1", "ctl2") else cfgs[n]
                twin = next((o for o in names if o in pipes and cfgs[o].hash == cfg.hash), None)
                if a.heldout and n == "c" and twin is not None:
                    # mxdb answered a peer's own config: (c) *is* that arm's kernel, so it runs
                    # that arm's pipeline (its own buffers would only time their placement)
                    pipes[n] = pipes[twin]
                elif a.heldout and n in ("a", "b") and "c" in pipes and cfgs["c"].hash == cfg.hash:
                    pipes[n] = pipes["c"]
                else:
                    pipes[n] = MoEPipeline(shape, cfg, w1, w2)
            pipes = {n: pipes[n] for n in [*names, *(["ctl1", "ctl2"] if "c" in cfgs else [])]}
            corr = {}
            for n, p in pipes.items():
                r = compare(p(x, tw, ids).clone(), ref, "bf16")
                corr[n] = [r.max_abs_err, r.rel_err, r.passed]
            reps, cps = instance_reps(m, a.instances if a.heldout else 1)
            order = list(pipes)
            g = time_interleaved(
                [lambda p=pipes[n]: p(x, tw, ids) for n in order],
                reps=reps, method="graph", calls_per_sample=cps, warmup=2,
                order_seed=info["seed"] if a.heldout else None,
            )  # fmt: skip
            graph = dict(zip(order, g, strict=True))
            eager: dict[str, list[float]] = {}
            if "c" in cfgs:
                key = cfgs["c"].hash
                lay = layers.get(key)
                if lay is None:
                    lay = layers[key] = MoELayer(w1, w2, fam.topk, lambda _m, c=cfgs["c"]: c)
                e = time_interleaved(
                    [
                        lambda: fm.fused_experts_impl(x, w1, w2, tw, ids),
                        lambda: lay(x, tw, ids),
                    ],
                    reps=reps, method="eager", calls_per_sample=cps, warmup=2,
                )  # fmt: skip
                eager = {"a": e[0], "c": e[1]}
            del pipes
            return {
                "seed": info["seed"],
                "order_seed": info["seed"] if a.heldout else None,
                "routing_class": info["rclass"],
                "ids": ids_np.tolist(),
                "configs": {n: cfgs[n].model_dump() for n in cfgs},
                "reasons": info["reasons"],
                "answered": info["answered"],
                "correctness": corr,
                "graph_us": graph,
                "eager_us": eager,
                "reps": reps,
                "calls_per_sample": cps,
            }

        for m, kind, drawn in plan:
            if time.monotonic() - t_start > a.deadline_s:
                doc["errors"].append(f"deadline: skipped {preset} M={m} {kind} and later")
                break
            try:
                timed = [time_instance(m, ids_np, info) for ids_np, info in drawn]
                point: dict[str, Any] = {
                    "family": preset,
                    "tokens": m,
                    "routing": kind,
                    "routing_params": HELDOUT[kind] if a.heldout else ROUTINGS[kind],
                    "generator": "logits" if a.heldout else kind,
                }
                if a.heldout:  # every instance on its own, with its index
                    point["reps"] = timed[0]["reps"]
                    point["calls_per_sample"] = timed[0]["calls_per_sample"]
                    point["instances"] = [{"instance": i, **t} for i, t in enumerate(timed)]
                else:  # the single-instance layout, as before
                    t = timed[0]
                    t.pop("order_seed")
                    point.update(t)
                doc["points"].append(point)
            except Exception as exc:  # keep going: failures are results
                doc["errors"].append(f"{preset} M={m} {kind}: {type(exc).__name__}: {exc}"[:500])
            atomic_json(out, doc)
            print(f"{preset} M={m} {kind} done at {time.monotonic() - t_start:.0f}s", flush=True)
        w1 = w2 = None
        layers.clear()
        torch.cuda.empty_cache()
    doc["wall_s"] = time.monotonic() - t_start
    atomic_json(out, doc)
    backend.close()


SHORT = {"mixtral-8x7b": "mixtral", "qwen3-30b-a3b": "qwen3"}
ROLE = {"a": "baseline", "b": "peer", "c": "candidate", "d": "candidate"}


def publish(raw_path: Path, bundle: Path) -> None:
    """Write the evidence bundle (runs, summary, report, ``peers.json``, plots) from the raw JSON.

    The bundle is built next to ``bundle`` and replaces it at the end; its fingerprint is the
    one the raw output recorded, and every figure of ``peers.json`` is computed from the runs'
    raw samples by ``mxdb.evidence.peers.build_peers`` (the auditor's own function).
    """

    from mxdb.evidence.files import atomic_write, dumps
    from mxdb.evidence.peers import (
        PEERS_FILE,
        REPORT_FILE,
        build_peers,
        render,
        to_json,
        trace_class,
        trace_figures,
    )
    from mxdb.evidence.summary import load_runs
    from mxdb.evidence.writer import BundleWriter, finish_bundle, staging_dir
    from mxdb.models import Fingerprint
    from mxdb.shapes import family_shape

    raw = json.loads(raw_path.read_text())
    fp = Fingerprint(**raw["fingerprint"])
    tmp = staging_dir(bundle)
    milestone = bundle.name
    w = BundleWriter(tmp, milestone=milestone, fingerprint=fp, bundle_id=bundle.name)
    points: list[dict[str, Any]] = []
    active: dict[str, int] = {}
    hot: dict[str, float] = {}
    classes: dict[str, str] = {}
    errors = list(raw.get("errors", []))
    copy = "a" if raw.get("rule") == "verdict" else "c"

    def record(p: dict[str, Any], inst: dict[str, Any], base: str, group: str) -> str:
        """Write one comparison's trace and runs (``inst``: a single-instance point or one
        instance of a point); returns the trace hash."""
        shape = family_shape(p["family"], p["tokens"], "bf16")
        th = w.add_trace(
            inst["ids"],
            experts=shape.experts,
            generator={
                "kind": p.get("generator", p["routing"]),
                "seed": inst["seed"],
                "params": p["routing_params"],
            },
        )
        active[th], hot[th] = trace_figures(inst["ids"])
        for n, samples in inst["graph_us"].items():
            key = copy if n.startswith("ctl") else n
            err, rel, ok = inst["correctness"][n]
            role = "control" if n.startswith("ctl") else ROLE[n]
            w.record(
                run_id=f"{base}-{n}",
                shape=shape,
                routing_class=group,
                config=inst["configs"][key],
                role=role,
                status="ok" if ok or role == "baseline" else "wrong",
                trace_hash=th,
                seed=inst["seed"],
                samples_us=samples,
                eager_samples_us=inst["eager_us"].get(n),
                max_abs_err=err,
                rel_err=rel,
                pair_id=f"{base}-ctl" if role == "control" else None,
            )
        return th

    for p in raw["points"]:
        base = f"{SHORT.get(p['family'], p['family'])}-m{p['tokens']}-{p['routing']}"
        if "instances" not in p:  # one routing instance per point (schema 1.0 / 1.1)
            th = record(p, p, base, p["routing"])
            points.append(
                {
                    "family": p["family"],
                    "tokens": p["tokens"],
                    "routing": p["routing"],
                    "routing_class": p["routing_class"],
                    "trace_hash": th,
                    "runs": {n: f"{base}-{n}" for n in p["graph_us"]},
                    "dispatch_reason_c": (p.get("reasons") or {}).get("c"),
                    "dispatch_reason_d": (p.get("reasons") or {}).get("d"),
                }
            )
            continue
        # schema 1.2: each instance its own trace and runs (summary group: the instance)
        insts = []
        for inst in p["instances"]:
            i = inst["instance"]
            th = record(p, inst, f"{base}-i{i}", f"{p['routing']}-instance{i}")
            shape = family_shape(p["family"], p["tokens"], "bf16")
            classes[th] = trace_class(inst["ids"], shape.experts)
            if classes[th] != inst["routing_class"]:
                errors.append(
                    f"{base} instance {i}: the run recorded class {inst['routing_class']}, "
                    f"its trace classifies as {classes[th]} (peers.json gives the trace's)"
                )
            insts.append(
                {
                    "instance": i,
                    "trace_hash": th,
                    "runs": {n: f"{base}-i{i}-{n}" for n in inst["graph_us"]},
                    "dispatch_reason_c": (inst.get("reasons") or {}).get("c"),
                    "dispatch_reason_d": (inst.get("reasons") or {}).get("d"),
                }
            )
        points.append(
            {
                "family": p["family"],
                "tokens": p["tokens"],
                "routing": p["routing"],
                "instances": insts,
            }
        )
    w.finish(bandwidth_bytes_per_s=raw["bandwidth_bytes_per_s"])
    runs = {r["run_id"]: r for r in load_runs(tmp)}
    doc = build_peers(
        points,
        runs,
        active,
        milestone=milestone,
        fingerprint_hash=fp.hash,
        bandwidth_bytes_per_s=raw["bandwidth_bytes_per_s"],
        dispatch_cost=raw.get("dispatch_cost") or {},
        errors=errors,
        hot_shares=hot,
        rule=raw.get("rule"),
        routing_source=raw.get("trace_source") if raw.get("rule") else None,
        trace_classes=classes or None,
        read_bandwidth_bytes_per_s=raw.get("read_bandwidth_bytes_per_s"),
        seed_salt=raw.get("seed_salt"),
        data_use=raw.get("data_use"),
        zero_shot=bool(raw.get("zero_shot")),
    )
    doc = to_json(doc)
    atomic_write(tmp / PEERS_FILE, dumps(doc))
    atomic_write_text(tmp / REPORT_FILE, render(doc))
    plots(doc, tmp / "report")
    finish_bundle(tmp, bundle, bundle_id=w.bundle_id, milestone=milestone)


def plots(doc: dict[str, Any], out: Path) -> None:
    f = {"points": doc["points"]}
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    for fam in sorted({r["family"] for r in f["points"]}):
        fig, axes = plt.subplots(1, 3, figsize=(15, 4), sharey=True)
        for ax, routing in zip(axes, ROUTINGS, strict=True):
            rows = [r for r in f["points"] if r["family"] == fam and r["routing"] == routing]
            ms = [r["tokens"] for r in rows]
            for n, lab in (("a", "FlagGems"), ("b", "vLLM table"), ("c", "mxdb")):
                ax.plot(ms, [r["floor_us"] / r["median_us"][n] for r in rows], "o-", label=lab)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{fam} {routing}")
            ax.set_xlabel("tokens M")
        axes[0].set_ylabel("fraction of memory-bound floor (GPU time)")
        axes[0].legend()
        fig.tight_layout()
        fig.savefig(out / f"floor-{SHORT.get(fam, fam)}.png", dpi=80)
        plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("out")
    r.add_argument("--store-export", default="evidence/store-export.json")
    r.add_argument(
        "--families",
        type=lambda v: v.split(","),
        default=list(FAMILIES),
        help="comma-separated model presets or family keys (E8-H4096-I3584-k2) to time "
        f"(default: {','.join(FAMILIES)})",
    )
    r.add_argument(
        "--zero-shot",
        action="store_true",
        help="families the store never measured: (c) is what an empty store with the "
        "performance model (--perf-model) answers, else the incumbent (needs --heldout)",
    )
    r.add_argument("--perf-model", default="evidence/h200-perf-model-3")
    r.add_argument(
        "--salt",
        default=None,
        help="with --heldout: the salt of the held-out seeds (default: drawn fresh for this "
        "run, recorded in peers.json; a salt used once is test data)",
    )
    r.add_argument(
        "--data-use",
        choices=("test", "development"),
        default="test",
        help="with --heldout: 'development' when this run's results are to guide a change "
        "(recorded in peers.json; the README quotes test runs)",
    )
    r.add_argument(
        "--workload",
        default=None,
        help="replay the traces this tuning workload replayed (e.g. "
        "examples/workloads/h200-peers.yaml), so (c) dispatches with the tuned routing class",
    )
    r.add_argument("--deadline-s", type=float, default=300.0)
    r.add_argument(
        "--heldout",
        action="store_true",
        help="time each point on held-out routing instances (generator kind logits) with "
        "copies of FlagGems' choice and a random order per round; judged by mxdb.verdict",
    )
    r.add_argument(
        "--instances",
        type=int,
        default=3,
        help="with --heldout: held-out instances per point (seeds heldout_seed(..., i), "
        "i < K; instance 0 is the single-instance runs' one), each timed in its own rounds "
        "(instance_reps); the point's verdict pools them (default 3)",
    )
    p = sub.add_parser("publish")
    p.add_argument("raw", type=Path)
    p.add_argument("bundle", type=Path)
    a = ap.parse_args()
    if a.cmd == "run" and a.instances < 1:
        ap.error("--instances must be at least 1")
    if a.cmd == "run" and a.zero_shot and not a.heldout:
        ap.error("--zero-shot needs --heldout")
    if a.cmd == "run":
        if a.salt is None:
            import secrets

            a.salt = secrets.token_hex(8)
        run(a)
    else:
        publish(a.raw, a.bundle)


if __name__ == "__main__":
    main()
