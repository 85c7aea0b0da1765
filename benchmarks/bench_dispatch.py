"""Benchmark: dispatch latency with 100,000 stored entries (CPU only).

Measures, on a real SQLite store:
  * opening the store and building a dispatcher (median of repeats);
  * the first lookup of a new key (a shape family not seen yet: one store query);
  * the first lookup of a new token count in a family already read (in memory);
  * the hit path of ``mxdb.dispatch(shape, routing_class)`` while another process keeps
    writing entries to the same store (so the dispatcher's background refresher re-reads
    the store every ``--refresh-interval`` seconds): every call timed on its own with
    ``perf_counter_ns``, reported as p50, p99 and p99.9 over all calls (no batch averages).
    The figures include one timer read per call; its own cost (an empty timed pair) is
    reported beside them.  A second run cycles over 300 cached keys of 300 families, so
    that every refresh touches many keys (the case where a refresh on the call path made
    the first call of each key after a write pay a store query).

Targets on a 2-core machine: hit p50 <= 0.3 us and p99.9 <= 5 us under the writer, first
lookup <= 200 us, open <= 100 ms.  Prints a table and writes the figures as JSON (default
benchmarks/results/bench_dispatch.json).

    python benchmarks/bench_dispatch.py [--entries 100000] [--calls 10000000] [--out FILE]
"""

from __future__ import annotations

import argparse
import array
import gc
import multiprocessing
import platform
import statistics
import tempfile
import time
from pathlib import Path

import mxdb
from mxdb import Dispatcher, DispatchOptions, KernelConfig, MoEShape
from mxdb.configs import GemmConfig
from mxdb.fileio import atomic_write_json
from mxdb.fingerprint import recorded
from mxdb.models import ROUTING_CLASSES, Entry
from mxdb.store import Store

FP = recorded("h200")
TOKENS = (
    1,
    2,
    4,
    8,
    16,
    32,
    64,
    128,
    256,
    512,
    1024,
    1536,
    2048,
    3072,
    4096,
    8192,
    12288,
    16384,
    24576,
    32768,
    49152,
    65536,
    98304,
    131072,
    262144,
)


def build(url: str, n: int) -> list[MoEShape]:
    """Fill the store with n verified entries over many shape families; return one shape per family."""
    configs = [
        KernelConfig.uniform(GemmConfig(block_m=bm, block_n=bn, block_k=64, num_stages=s))
        for bm in (16, 32, 64)
        for bn in (64, 128)
        for s in (2, 3)
    ]
    per_family = len(TOKENS) * len(ROUTING_CLASSES)
    families = -(-n // per_family)
    shapes: list[MoEShape] = []
    entries: list[Entry] = []
    for f in range(families):
        shape = MoEShape(8 + f % 120, 1024 + 64 * (f // 120), 768, 2, 1, "bf16")
        shapes.append(shape)
        for t in TOKENS:
            for rc in ROUTING_CLASSES:
                if len(entries) >= n:
                    break
                s = shape.with_tokens(t)
                c = configs[(f + t) % len(configs)]
                entries.append(
                    Entry(
                        op=s.op,
                        dtype=s.dtype,
                        family=s.family,
                        dims=s.dims(),
                        tokens=t,
                        routing_class=rc,
                        config=c.model_dump(),
                        config_hash=c.hash,
                        fingerprint_hash=FP.hash,
                        device_name=FP.device_name,
                        status="verified",
                        source="bench",
                        speedup=1.05,
                        noise_band=0.01,
                    )
                )
    with Store.open(url) as store:
        store.put_fingerprint(FP)
        for i in range(0, len(entries), 20000):
            store.add_entries(entries[i : i + 20000])
    return shapes


def writer(url: str, stop: multiprocessing.synchronize.Event, period_s: float) -> None:
    """Another process: add one entry of a family nobody dispatches every ``period_s``."""
    store = Store.open(url)
    cfg = KernelConfig.uniform(GemmConfig(block_m=16, block_n=64, block_k=64))
    i = 0
    while not stop.is_set():
        s = MoEShape(7, 4096, 777, 2, 1 + i, "bf16")
        store.add_entries(
            [
                Entry(
                    op=s.op,
                    dtype=s.dtype,
                    family=s.family,
                    dims=s.dims(),
                    tokens=s.tokens,
                    routing_class="uniform",
                    config=cfg.model_dump(),
                    config_hash=cfg.hash,
                    fingerprint_hash=FP.hash,
                    device_name=FP.device_name,
                    status="verified",
                    source="bench-writer",
                    speedup=1.01,
                    noise_band=0.01,
                )
            ]
        )
        i += 1
        time.sleep(period_s)
    store.close()


def per_call_ns(dispatch: object, hot: MoEShape, calls: int) -> array.array[int]:
    """Each call of ``dispatch(hot, 'uniform')`` timed on its own (ns, timer read included)."""
    fn = dispatch  # type: ignore[assignment]
    clock = time.perf_counter_ns
    out = array.array("q", bytes(8 * calls))
    for i in range(calls):
        t0 = clock()
        fn(hot, "uniform")  # type: ignore[operator]
        out[i] = clock() - t0
    return out


def cycling_ns(dispatch: object, keys: list[MoEShape], calls: int) -> array.array[int]:
    """Calls cycling over many cached keys (each timed), so refreshes touch every one."""
    fn = dispatch  # type: ignore[assignment]
    clock = time.perf_counter_ns
    out = array.array("q", bytes(8 * calls))
    n = len(keys)
    for i in range(calls):
        key = keys[i % n]
        t0 = clock()
        fn(key, "uniform")  # type: ignore[operator]
        out[i] = clock() - t0
    return out


def timer_ns(calls: int) -> array.array[int]:
    clock = time.perf_counter_ns
    out = array.array("q", bytes(8 * calls))
    for i in range(calls):
        t0 = clock()
        out[i] = clock() - t0
    return out


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--calls", type=int, default=10_000_000, help="timed hit-path calls")
    ap.add_argument(
        "--refresh-interval", type=float, default=0.1, help="dispatcher refresh interval (s)"
    )
    ap.add_argument(
        "--writer-period", type=float, default=0.01, help="seconds between the writer's writes"
    )
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "bench_dispatch.json"
    )
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/bench.sqlite"
        t0 = time.perf_counter()
        shapes = build(url, args.entries)
        fill_s = time.perf_counter() - t0

        opens = []
        for _ in range(7):
            t0 = time.perf_counter()
            store = Store.open(url)
            Dispatcher(store, FP)
            opens.append((time.perf_counter() - t0) * 1e3)
            store.close()

        store = Store.open(url)
        disp = mxdb.configure(
            store, fingerprint=FP, options=DispatchOptions(refresh_interval=args.refresh_interval)
        )
        first_family_us = []
        for shape in shapes[:300]:
            s = shape.with_tokens(64)
            t0 = time.perf_counter_ns()
            d = disp.dispatch(s, "uniform")
            first_family_us.append((time.perf_counter_ns() - t0) / 1e3)
            assert d.level == "exact", d
        first_key_us = []
        for shape in shapes[:300]:
            s = shape.with_tokens(48)  # new token count, family rows already in memory
            t0 = time.perf_counter_ns()
            disp.dispatch(s, "skewed")
            first_key_us.append((time.perf_counter_ns() - t0) / 1e3)

        hot = shapes[0].with_tokens(64)
        dispatch = mxdb.dispatch
        assert dispatch(hot, "uniform").level == "exact"
        gen0 = store.generation()
        ctx = multiprocessing.get_context("spawn")
        stop = ctx.Event()
        proc = ctx.Process(target=writer, args=(url, stop, args.writer_period), daemon=True)
        proc.start()
        while store.generation() == gen0:  # the writer is writing
            time.sleep(0.01)
        gc.disable()
        t0 = time.perf_counter()
        samples = per_call_ns(dispatch, hot, args.calls)
        measure_s = time.perf_counter() - t0
        many = [shape.with_tokens(64) for shape in shapes[:300]]
        cycling = cycling_ns(dispatch, many, args.calls)
        timer = timer_ns(min(args.calls, 1_000_000))
        gc.enable()
        stop.set()
        proc.join(30)
        writes = store.generation() - gen0
        seen_writes = disp._generation - gen0
        assert dispatch(hot, "uniform").level == "exact"
        getattr(disp, "close", lambda: None)()  # (older dispatchers have no refresher)
        store.close()

    hit = sorted(samples)
    cyc = sorted(cycling)
    timer_sorted = sorted(timer)

    def q(values: list[int], p: float) -> float:
        return values[min(len(values) - 1, int(p / 100 * len(values)))] / 1e3

    result = {
        "benchmark": "bench_dispatch",
        "entries": args.entries,
        "families": len(shapes),
        "machine": {
            "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(),
            "cpus": __import__("os").cpu_count(),
        },
        "fill_seconds": round(fill_s, 2),
        "open_ms": {"median": round(statistics.median(opens), 2), "max": round(max(opens), 2)},
        "first_lookup_new_family_us": {
            "p50": round(pct(first_family_us, 50), 1),
            "p99": round(pct(first_family_us, 99), 1),
        },
        "first_lookup_new_key_us": {
            "p50": round(pct(first_key_us, 50), 1),
            "p99": round(pct(first_key_us, 99), 1),
        },
        "hit_us": {
            "p50": round(q(hit, 50), 3),
            "p99": round(q(hit, 99), 3),
            "p99_9": round(q(hit, 99.9), 3),
            "p99_99": round(q(hit, 99.99), 3),
            "max": round(hit[-1] / 1e3, 1),
            "calls_over_50us": sum(1 for v in hit[-100_000:] if v > 50_000),
            "calls": len(hit),
            "seconds": round(measure_s, 2),
            "method": "every call of mxdb.dispatch(shape, 'uniform') timed on its own with "
            "perf_counter_ns (one timer read included), while another process wrote entries",
        },
        "hit_300_keys_us": {
            "p50": round(q(cyc, 50), 3),
            "p99": round(q(cyc, 99), 3),
            "p99_9": round(q(cyc, 99.9), 3),
            "p99_99": round(q(cyc, 99.99), 3),
            "max": round(cyc[-1] / 1e3, 1),
            "calls_over_50us": sum(1 for v in cyc[-100_000:] if v > 50_000),
            "method": "the same, calls cycling over 300 cached keys of 300 shape families",
        },
        "timer_us": {"p50": round(q(timer_sorted, 50), 3), "p99": round(q(timer_sorted, 99), 3)},
        "concurrent_writer": {
            "period_s": args.writer_period,
            "writes_during_run": writes,
            "refresh_interval_s": args.refresh_interval,
            "writes_seen_by_dispatcher": seen_writes,
        },
        "targets": {"hit_p50_us": 0.3, "hit_p99_9_us": 5.0, "first_lookup_us": 200, "open_ms": 100},
    }
    result["meets_targets"] = {
        "hit_p50": result["hit_us"]["p50"] <= 0.3,
        "hit_p99_9": result["hit_us"]["p99_9"] <= 5.0,
        "hit_300_keys_p99_9": result["hit_300_keys_us"]["p99_9"] <= 5.0,
        "first_lookup": result["first_lookup_new_family_us"]["p50"] <= 200,
        "open": result["open_ms"]["median"] <= 100,
    }
    print(f"entries {args.entries} in {len(shapes)} families (filled in {fill_s:.1f} s)")
    print(
        f"open store + dispatcher   median {result['open_ms']['median']:8.2f} ms   (target <= 100 ms)"
    )
    print(
        f"first lookup, new family  p50 {result['first_lookup_new_family_us']['p50']:8.1f} us  "
        f"p99 {result['first_lookup_new_family_us']['p99']:8.1f} us   (target <= 200 us)"
    )
    print(
        f"first lookup, new key     p50 {result['first_lookup_new_key_us']['p50']:8.1f} us  "
        f"p99 {result['first_lookup_new_key_us']['p99']:8.1f} us"
    )
    h = result["hit_us"]
    print(
        f"hit path, writer running  p50 {h['p50']:8.3f} us  p99 {h['p99']:8.3f} us  "
        f"p99.9 {h['p99_9']:8.3f} us  p99.99 {h['p99_99']:8.3f} us  max {h['max']:.1f} us "
        f"over {h['calls']:,} calls, {h['calls_over_50us']} over 50 us "
        "(targets p50 <= 0.3 us, p99.9 <= 5 us)"
    )
    c = result["hit_300_keys_us"]
    print(
        f"hit path, 300 keys        p50 {c['p50']:8.3f} us  p99 {c['p99']:8.3f} us  "
        f"p99.9 {c['p99_9']:8.3f} us  p99.99 {c['p99_99']:8.3f} us  max {c['max']:.1f} us, "
        f"{c['calls_over_50us']} over 50 us"
    )
    print(
        f"timer read alone          p50 {result['timer_us']['p50']:8.3f} us  "
        f"(included in the figures above)"
    )
    w = result["concurrent_writer"]
    print(
        f"writer: {w['writes_during_run']} writes during the run; the dispatcher saw "
        f"{w['writes_seen_by_dispatcher']} (refresh every {w['refresh_interval_s']} s)"
    )
    atomic_write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
