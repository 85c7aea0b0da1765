"""GPU benchmark: static dispatch vs online self-healing when one config slows down 10x.

``run OUT`` (CUDA GPU, FlagGems 5.0.2): a store holds two verified configs for one MoE layer
call (A, the best, and B, the next-best) with their medians, measured here first (per-call
CUDA events, A and B interleaved).  A stream of layer calls runs through the FlagGems hook in
three phases: normal, A slowed down 10x (FlagGems' GEMM launcher repeats A's launches 10
times: same results, 10x the GEMM time) and recovered.  The static hook keeps A throughout;
the self-healing hook samples every N-th call, moves to B and back.  Each phase is timed in
batches with CUDA events at batch boundaries (no synchronization inside a phase).  Then the
sampling overhead: eager time per layer call of a small (host-bound) layer without the hook,
with the hook, and with healing samples every N = 4096, 64 and 4 calls, interleaved
repetitions.  Raw results go to OUT/raw.json after every step (``status`` says how far it
got; a failing step is recorded in ``errors`` and the next one runs).

``publish RAW OUT`` (CPU): builds the ``mxdb.self-healing`` document from raw.json, with every
claim recomputed from the raw batches, and writes an evidence bundle that ``mxdb audit``
checks.

    python benchmarks/self_healing.py run OUT [--calls 1200] [--budget-s 70]
    python benchmarks/self_healing.py publish OUT/raw.json evidence/h200-self-healing
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mxdb import Dispatcher, KernelConfig, MoEShape
from mxdb.configs import GemmConfig
from mxdb.fileio import atomic_write_json
from mxdb.models import Entry, Fingerprint
from mxdb.runtime.healing import HealingOptions

E, H, I, K, M = 8, 4096, 14336, 2, 64  # noqa: E741  (Mixtral-8x7B layer, 64 tokens)
SMALL = (8, 1024, 1024, 2, 16)  # a host-bound layer for the sampling overhead
CFG_A = KernelConfig.uniform(
    GemmConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
)
CFG_B = KernelConfig.uniform(
    GemmConfig(block_m=16, block_n=128, block_k=64, num_warps=4, num_stages=3)
)
SLOWDOWN = 10
OVERHEAD_EVERY = (4096, 64, 4)
MIN_CALLS = 600  # enough for the healing stream to switch (~100 calls) and recover (~300)


class Raw:
    """The raw output, rewritten atomically after every step."""

    def __init__(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "raw.json"
        self.data: dict[str, Any] = {"status": "started", "errors": [], "timings_s": {}}
        self.t0 = time.monotonic()
        self.save()

    def save(self) -> None:
        atomic_write_json(self.path, self.data)

    def step(self, name: str, fn: Callable[[], Any]) -> Any:
        t = time.monotonic()
        try:
            value = fn()
        except Exception as exc:
            tb = traceback.format_exc(limit=6)
            self.data["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
            print(tb, file=sys.stderr, flush=True)
            value = None
        self.data["timings_s"][name] = round(time.monotonic() - t, 3)
        self.data["status"] = f"after {name}"
        self.save()
        print(f"[{time.monotonic() - self.t0:6.1f}s] {name} done", flush=True)
        return value

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


def _entry(
    shape: MoEShape, cfg: KernelConfig, fph: str, speedup: float, med: float | None
) -> Entry:
    return Entry(
        dtype=shape.dtype, family=shape.family, dims=shape.dims(), tokens=shape.tokens,
        routing_class="uniform", config=cfg.model_dump(), config_hash=cfg.hash,
        fingerprint_hash=fph, status="verified", source="tune", speedup=speedup,
        noise_band=0.01, median_us=med,
    )  # fmt: skip


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2.0


class Bench:
    """The GPU side (torch, FlagGems): everything here runs only under ``run``."""

    def __init__(self, a: argparse.Namespace, raw: Raw) -> None:
        import flag_gems.fused.fused_moe as fm
        import torch

        from mxdb.dispatcher import current_fingerprint

        self.torch, self.fm, self.a, self.raw = torch, fm, a, raw
        self.fp: Fingerprint = current_fingerprint()
        raw.data["fingerprint"] = self.fp.model_dump(mode="json")
        self.tmp = Path(tempfile.mkdtemp(prefix="mxdb-self-healing-"))
        self.shape = MoEShape(E, H, I, K, M, "bf16")
        self.args = self._inputs(E, H, I, K, M, seed=0)
        self.orig_config_fn = fm.try_get_optimal_moe_config
        # The slowdown injection wraps FlagGems' GEMM launcher and finds its config argument
        # by name (dispatch_fused_moe_kernel in 5.0.2; invoke_fused_moe_triton_kernel before).
        name = (
            "dispatch_fused_moe_kernel"
            if hasattr(fm, "dispatch_fused_moe_kernel")
            else "invoke_fused_moe_triton_kernel"
        )
        self.launch_name = name
        self.orig_launch = getattr(fm, name)
        self.config_pos = list(inspect.signature(self.orig_launch).parameters).index("config")
        self.slow = {"on": False, "count": 0}
        a_tr = CFG_A.gemm1.to_triton()
        self.a_sig = tuple(a_tr[k] for k in ("BLOCK_SIZE_N", "BLOCK_SIZE_K", "num_stages"))
        raw.data["injection"] = {"function": name, "config_position": self.config_pos}

    def _inputs(self, e: int, h: int, i: int, k: int, m: int, seed: int) -> tuple[Any, ...]:
        torch = self.torch
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, generator=g)
        w1 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(m)])
        tw = torch.full((m, k), 1.0 / k, device="cuda", dtype=torch.float32)
        return (x, w1, w2, tw, ids.to(torch.int32))

    # -- the injection and fixed configs ------------------------------------------------------

    def inject(self) -> None:
        orig, pos, slow, a_sig = self.orig_launch, self.config_pos, self.slow, self.a_sig

        def launch(*la: Any, **kw: Any) -> Any:
            config = la[pos] if len(la) > pos else kw.get("config")
            if slow["on"] and isinstance(config, dict):
                sig = tuple(config.get(k) for k in ("BLOCK_SIZE_N", "BLOCK_SIZE_K", "num_stages"))
                if sig == a_sig:
                    slow["count"] += 1
                    for _ in range(SLOWDOWN - 1):  # C is overwritten, not accumulated
                        orig(*la, **kw)
            return orig(*la, **kw)

        setattr(self.fm, self.launch_name, launch)

    def restore(self) -> None:
        setattr(self.fm, self.launch_name, self.orig_launch)
        self.fm.try_get_optimal_moe_config = self.orig_config_fn
        import mxdb

        mxdb.uninstall()

    def fixed(self, cfg: KernelConfig | None) -> None:
        """FlagGems with ``cfg`` for every call (None: its own choice), without the hook."""
        if cfg is None:
            self.fm.try_get_optimal_moe_config = self.orig_config_fn
        else:
            tr = cfg.gemm1.to_triton()
            self.fm.try_get_optimal_moe_config = lambda *a, **k: dict(tr)

    # -- steps -----------------------------------------------------------------------------

    def calibrate(self) -> dict[str, float]:
        """Per-call CUDA-event timings of A and B, interleaved; warms up (compiles) both."""
        torch, fm = self.torch, self.fm
        t = time.monotonic()
        for cfg in (CFG_A, CFG_B):
            self.fixed(cfg)
            for _ in range(10):
                fm.fused_experts_impl(*self.args)
        torch.cuda.synchronize()
        self.raw.data["compile_warmup_s"] = round(time.monotonic() - t, 3)
        samples: dict[str, list[float]] = {"A": [], "B": []}
        for _ in range(self.a.calibration_rounds):
            for label, cfg in (("A", CFG_A), ("B", CFG_B)):
                self.fixed(cfg)
                evs = []
                for _ in range(20):
                    st = torch.cuda.Event(enable_timing=True)
                    en = torch.cuda.Event(enable_timing=True)
                    st.record()
                    fm.fused_experts_impl(*self.args)
                    en.record()
                    evs.append((st, en))
                torch.cuda.synchronize()
                samples[label] += [st.elapsed_time(en) * 1000.0 for st, en in evs]
        self.fixed(None)
        runs: list[dict[str, Any]] = []
        for label, cfg in (("A", CFG_A), ("B", CFG_B)):
            runs.append({
                "label": label, "config": cfg.model_dump(), "config_hash": cfg.hash,
                "samples_us": samples[label], "median_us": _median(samples[label]),
            })  # fmt: skip
        self.raw.data["calibration"] = runs
        return {r["label"]: r["median_us"] for r in runs}

    def make_store(self, medians: dict[str, float]) -> Any:
        from mxdb.store import Store

        store = Store.open(f"sqlite:///{self.tmp / 'mxdb.sqlite'}")
        store.put_fingerprint(self.fp)
        fph = self.fp.hash
        small = MoEShape(*SMALL[:4], SMALL[4], "bf16")
        store.add_entries([
            _entry(self.shape, CFG_A, fph, 1.3, medians["A"]),
            _entry(self.shape, CFG_B, fph, 1.1, medians["B"]),
            _entry(small, CFG_A, fph, 1.2, None),
        ])  # fmt: skip
        alts = Dispatcher(store, self.fp).alternatives(self.shape, "uniform")
        ranked = [d.config.hash if d.config else None for d in alts]
        self.raw.data["dispatch_ranking"] = ranked
        if ranked[:2] != [CFG_A.hash, CFG_B.hash]:
            raise RuntimeError(f"dispatcher ranks {ranked}, expected A then B")
        return store

    def calls_per_phase(self, medians: dict[str, float]) -> int:
        """The requested calls per phase, shrunk to fit the time budget (never below MIN)."""
        ma, mb = medians["A"], medians["B"]
        # static: A, 10x A, A; healing: A, ~B, A; plus ~30 us host time per call
        per_call_us = 5 * ma + SLOWDOWN * ma + mb + 6 * 30.0
        reserve = self.a.overhead_reserve_s
        left = self.a.budget_s - self.raw.elapsed() - reserve
        fit = int(left * 1e6 / per_call_us) if left > 0 else 0
        n = max(MIN_CALLS, min(self.a.calls, fit))
        self.raw.data["calls_planned"] = {"requested": self.a.calls, "fit": fit, "used": n}
        return n

    def stream(self, store: Any, mode: str, calls: int) -> dict[str, Any]:
        import mxdb

        torch = self.torch
        healing = HealingOptions(sample_every=self.a.sample_every) if mode == "healing" else None
        self.fixed(None)
        # FlagGems' path: the injection wraps its GEMM launcher, which the lean layer bypasses
        hook = mxdb.install(
            Dispatcher(store, self.fp), monitor_every=0, healing=healing, lean=False
        )
        transitions: list[dict[str, Any]] = []
        healer = hook.healer
        if healer is not None:
            inner = healer.on_change

            def on_change(key: Any, decision: Any, is_orig: bool) -> None:
                t = healer.transitions[-1]  # logged just before on_change is called
                transitions.append({
                    "call": hook.counters["calls"], "kind": t.kind, "from": t.from_index,
                    "to": t.to_index, "ratio": t.ratio,
                })  # fmt: skip
                if inner is not None:
                    inner(key, decision, is_orig)

            healer.on_change = on_change

        def active() -> int:
            if healer is None:
                return 0
            keys = healer.keys()
            return healer.active(keys[0]) if keys else 0

        fn = self.fm.fused_experts_impl
        args = self.args
        for _ in range(self.a.batch):  # warm: the hook's first lookups
            fn(*args)
        phases = []
        try:
            for name, slowed in (("normal", False), ("slowed", True), ("recovered", False)):
                c0 = self.slow["count"]
                first = hook.counters["calls"] + 1
                torch.cuda.synchronize()  # phase boundary only, never inside a phase
                t0 = time.perf_counter()
                self.slow["on"] = slowed
                ev0 = torch.cuda.Event(enable_timing=True)
                ev0.record()
                evs, sizes, actives = [ev0], [], []
                done = 0
                while done < calls:
                    n = min(self.a.batch, calls - done)
                    for _ in range(n):
                        fn(*args)
                    ev = torch.cuda.Event(enable_timing=True)
                    ev.record()
                    evs.append(ev)
                    sizes.append(n)
                    actives.append(active())
                    done += n
                torch.cuda.synchronize()
                wall = time.perf_counter() - t0
                self.slow["on"] = False
                batches = [
                    {"calls": n, "gpu_us": evs[i].elapsed_time(evs[i + 1]) * 1000.0, "active": act}
                    for i, (n, act) in enumerate(zip(sizes, actives, strict=True))
                ]
                phases.append({
                    "name": name, "slowed": slowed, "first_call": first,
                    "slowed_launches": self.slow["count"] - c0, "host_wall_s": wall,
                    "batches": batches,
                })  # fmt: skip
                cps = done / (sum(b["gpu_us"] for b in batches) / 1e6)
                print(f"  {mode:8s} {name:10s} {cps:9.1f} calls/s  active at end {actives[-1]}")
        finally:
            self.slow["on"] = False
            stats = hook.stats()
            mxdb.uninstall()
        stats.pop("transitions", None)
        return {"mode": mode, "phases": phases, "transitions": transitions, "counters": stats}

    def overhead(self, store: Any) -> dict[str, Any]:
        """Eager time per call of the small layer: no hook, hook, hook + healing every N."""
        from mxdb.runtime.hook import Hook

        torch, fm = self.torch, self.fm
        setattr(fm, self.launch_name, self.orig_launch)  # no injection wrapper here
        args = self._inputs(*SMALL, seed=1)
        L = self.a.overhead_calls
        # FlagGems' path, as the recorded overhead ladder measured it
        hooks: dict[str, Any] = {
            "unhooked": None,
            "hooked": Hook(Dispatcher(store, self.fp), lean=False),
        }
        for n in OVERHEAD_EVERY:
            hooks[f"every_{n}"] = Hook(
                Dispatcher(store, self.fp), healing=HealingOptions(sample_every=n), lean=False
            )
        per: dict[str, list[float]] = {m: [] for m in hooks}
        inwin: dict[str, list[int]] = {m: [] for m in hooks}
        reps = self.a.overhead_reps
        warm_us: dict[str, float] = {}
        rep = 0
        while rep <= reps:  # rep 0 warms up: compiles, tracks every healing key
            for mode, hook in hooks.items():
                if hook is None:
                    self.fixed(CFG_A)
                else:
                    self.fixed(None)
                    hook.patch()
                try:
                    fn = fm.fused_experts_impl
                    s0 = hook.counters["healing_samples"] if hook else 0
                    calls = L if (rep > 0 or mode == f"every_{max(OVERHEAD_EVERY)}") else 64
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        fn(*args)
                    torch.cuda.synchronize()
                    us = (time.perf_counter() - t0) * 1e6 / calls
                finally:
                    if hook is not None:
                        hook.unpatch()
                self.fixed(None)
                if rep > 0:
                    per[mode].append(us)
                    inwin[mode].append((hook.counters["healing_samples"] - s0) if hook else 0)
                else:
                    warm_us[mode] = us
            if rep == 0:  # fit the timed repetitions into what is left of the budget
                rep_s = sum(warm_us.values()) * L / 1e6
                left = self.a.budget_s - self.raw.elapsed()
                reps = max(1, min(reps, int(left / rep_s) if rep_s > 0 else reps))
                self.raw.data["overhead_reps_used"] = reps
            rep += 1
        modes = []
        for mode in hooks:
            every = int(mode.split("_")[1]) if mode.startswith("every_") else None
            modes.append({
                "mode": mode, "sample_every": every, "us_per_call": per[mode],
                "samples_in_window": inwin[mode],
            })  # fmt: skip
            print(f"  overhead {mode:11s} {_median(per[mode]):8.2f} us/call")
        small = MoEShape(*SMALL[:4], SMALL[4], "bf16")
        return {"shape": small.to_dict(), "calls_per_rep": L, "warm_reps": 1, "modes": modes}


def run(a: argparse.Namespace) -> int:
    raw = Raw(a.out)
    raw.data["setup"] = {
        "shape": MoEShape(E, H, I, K, M, "bf16").to_dict(),
        "slowdown": float(SLOWDOWN),
        "calls_per_phase": a.calls,
        "batch_calls": a.batch,
        "healing_options": dataclasses.asdict(HealingOptions(sample_every=a.sample_every)),
        "candidates": ["A", "B"],
        "timing": "eager stream of fused_experts_impl calls; CUDA events at batch boundaries; "
        f"slowdown: {SLOWDOWN}x launches of config A's GEMMs",
    }
    raw.save()
    bench = raw.step("init", lambda: Bench(a, raw))
    if bench is None:
        raw.data["status"] = "failed: no GPU bench (see errors)"
        raw.save()
        return 1
    try:
        bench.inject()
        medians = raw.step("calibrate", bench.calibrate)
        store = raw.step("store", lambda: bench.make_store(medians)) if medians else None
        if store is not None:
            calls = bench.calls_per_phase(medians)
            raw.data["setup"]["calls_per_phase"] = calls
            streams: list[dict[str, Any]] = []
            raw.data["streams"] = streams
            for mode in ("static", "healing"):
                s = raw.step(f"stream_{mode}", lambda m=mode: bench.stream(store, m, calls))  # type: ignore[misc]
                if s is not None:
                    streams.append(s)
                    raw.save()
            if a.overhead_calls > 0:
                raw.data["overhead"] = raw.step("overhead", lambda: bench.overhead(store))
    finally:
        try:
            bench.restore()
        except Exception as exc:
            raw.data["errors"].append(f"restore: {exc}")
    raw.data["status"] = "complete" if not raw.data["errors"] else "partial"
    raw.data["wall_s"] = round(raw.elapsed(), 3)
    raw.save()
    print(f"{raw.data['status']} in {raw.data['wall_s']} s; wrote {raw.path}")
    return 0 if not raw.data["errors"] else 1


def publish(a: argparse.Namespace) -> int:
    from mxdb.evidence.healing import build_document, write_healing_bundle

    doc = build_document(json.loads(Path(a.raw).read_text()), milestone=a.milestone)
    root = write_healing_bundle(a.out, doc)
    c = doc.claims
    print(json.dumps({"ratio": c.ratio, "switch_call": c.switch_call,
                      "recover_call": c.recover_call, "met": c.met}, indent=1))  # fmt: skip
    print(f"wrote {root}; check it with: mxdb audit {root}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="measure on the GPU; writes OUT/raw.json progressively")
    r.add_argument("out", type=Path, help="directory for raw.json (created)")
    r.add_argument("--calls", type=int, default=1200, help="layer calls per phase (max)")
    r.add_argument("--batch", type=int, default=20, help="calls per timed batch")
    r.add_argument("--sample-every", type=int, default=16, help="healing sample interval")
    r.add_argument("--calibration-rounds", type=int, default=8, help="x 20 calls per config")
    r.add_argument("--budget-s", type=float, default=70.0, help="wall budget of the run")
    r.add_argument("--overhead-reserve-s", type=float, default=15.0, help="kept for overhead")
    r.add_argument("--overhead-calls", type=int, default=4096, help="calls per rep (0: skip)")
    r.add_argument("--overhead-reps", type=int, default=3, help="timed repetitions per mode")
    p = sub.add_parser("publish", help="build the evidence bundle from raw.json (CPU)")
    p.add_argument("raw", type=Path, help="raw.json written by run")
    p.add_argument("out", type=Path, help="new bundle directory")
    p.add_argument("--milestone", default="h200-self-healing", help="bundle milestone")
    a = ap.parse_args(argv)
    return run(a) if a.cmd == "run" else publish(a)


if __name__ == "__main__":
    sys.exit(main())
