"""GPU benchmark: static dispatch vs online self-healing when one config slows down 10x.

On a CUDA GPU with FlagGems 5.0.2: a store holds two verified configs for one MoE layer call
(A, the best, and B, the next-best), with their medians measured here first.  A stream of
layer calls runs through ``mxdb.install`` in three phases: normal, A slowed down 10x (its
GEMM launches repeated 10 times, same results), and recovered.  The static hook keeps A
throughout; the self-healing hook moves to B and back.  Throughput (calls/s) per phase and
the healing transitions go to an evidence bundle (fingerprint.json, results.json, manifest).

    python benchmarks/self_healing.py --out evidence/self-healing-h200 [--calls 3000]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import mxdb
from mxdb import Dispatcher, KernelConfig, MoEShape
from mxdb.configs import GemmConfig
from mxdb.dispatcher import current_fingerprint
from mxdb.fileio import atomic_write_json
from mxdb.fingerprint import fingerprint_document
from mxdb.models import Entry
from mxdb.runtime.healing import HealingOptions
from mxdb.store import Store

E, H, I, K, M = 8, 4096, 14336, 2, 64  # noqa: E741
CFG_A = KernelConfig.uniform(
    GemmConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
)
CFG_B = KernelConfig.uniform(
    GemmConfig(block_m=16, block_n=128, block_k=64, num_warps=4, num_stages=3)
)
SLOWDOWN = 10


def _stream(fm: Any, args: tuple[Any, ...], calls: int) -> float:
    torch.cuda.synchronize()  # phase boundary only, never per call
    t0 = time.perf_counter()
    for _ in range(calls):
        fm.fused_experts_impl(*args)
    torch.cuda.synchronize()
    return calls / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="new evidence bundle directory")
    ap.add_argument("--calls", type=int, default=3000, help="layer calls per phase")
    ap.add_argument("--sample-every", type=int, default=16, help="healing sample interval")
    a = ap.parse_args()
    import flag_gems.fused.fused_moe as fm

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(M, H, device=dev, dtype=torch.bfloat16, generator=g)
    w1 = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    w2 = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:K] for _ in range(M)]).int()
    tw = torch.full((M, K), 1.0 / K, device=dev, dtype=torch.float32)
    args = (x, w1, w2, tw, ids)

    # Slowdown injection: FlagGems' GEMM launcher repeats config A's launches.
    orig_launch = fm.dispatch_fused_moe_kernel
    slow = {"on": False}
    a_block_n = CFG_A.gemm1.block_n

    def launch(*la: Any, **kw: Any) -> Any:
        config = la[12] if len(la) > 12 else kw["config"]
        reps = SLOWDOWN if slow["on"] and config["BLOCK_SIZE_N"] == a_block_n else 1
        for _ in range(reps):
            out = orig_launch(*la, **kw)
        return out

    fm.dispatch_fused_moe_kernel = launch

    fp = current_fingerprint()
    tmp = Path(tempfile.mkdtemp(prefix="mxdb-self-healing-"))
    store = Store.open(f"sqlite:///{tmp / 'mxdb.sqlite'}")
    store.put_fingerprint(fp)
    shape = MoEShape(E, H, I, K, M, "bf16")
    medians = {}
    for cfg in (CFG_A, CFG_B):  # record each config's median through the hook, as tuned
        s = Store.open(f"sqlite:///{tmp / (cfg.hash + '.sqlite')}")
        s.put_fingerprint(fp)
        s.add_entries([_entry(shape, cfg, fp.hash, 1.0, None)])
        mxdb.install(Dispatcher(s, fp), monitor_every=0)
        for _ in range(50):
            fm.fused_experts_impl(*args)
        times = []
        for _ in range(200):
            st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            st.record()
            fm.fused_experts_impl(*args)
            en.record()
            en.synchronize()
            times.append(st.elapsed_time(en) * 1000)
        medians[cfg.hash] = statistics.median(times)
        mxdb.uninstall()
        s.close()
    store.add_entries(
        [_entry(shape, CFG_A, fp.hash, 1.3, medians[CFG_A.hash]),
         _entry(shape, CFG_B, fp.hash, 1.1, medians[CFG_B.hash])]
    )  # fmt: skip

    results: dict[str, Any] = {"medians_us": medians}
    for mode in ("static", "healing"):
        healing = HealingOptions(sample_every=a.sample_every) if mode == "healing" else None
        hook = mxdb.install(Dispatcher(store, fp), monitor_every=0, healing=healing)
        phases = {}
        for phase, on in (("normal", False), ("slowed", True), ("recovered", False)):
            slow["on"] = on
            phases[phase] = round(_stream(fm, args, a.calls), 1)
        results[mode] = {"calls_per_s": phases, "stats": hook.stats()}
        mxdb.uninstall()
    slow["on"] = False
    fm.dispatch_fused_moe_kernel = orig_launch
    st_, he = results["static"]["calls_per_s"], results["healing"]["calls_per_s"]
    results["speedup_while_slowed"] = round(he["slowed"] / st_["slowed"], 3)
    results["setup"] = {"shape": shape.to_dict(), "slowdown": SLOWDOWN, "calls_per_phase": a.calls,
                        "configs": {"A": CFG_A.model_dump(), "B": CFG_B.model_dump()}}  # fmt: skip

    a.out.mkdir(parents=True, exist_ok=False)
    atomic_write_json(a.out / "fingerprint.json", fingerprint_document(fp))
    atomic_write_json(a.out / "results.json", results)
    manifest = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(a.out.iterdir())}
    atomic_write_json(a.out / "manifest.json", {"schema": "mxdb.self-healing", "files": manifest})
    print(json.dumps({k: results[k] for k in ("medians_us", "speedup_while_slowed")}, indent=2))
    print("static ", st_, "\nhealing", he, f"\nwrote {a.out}")


def _entry(
    shape: MoEShape, cfg: KernelConfig, fph: str, speedup: float, med: float | None
) -> Entry:
    return Entry(
        dtype=shape.dtype, family=shape.family, dims=shape.dims(), tokens=shape.tokens,
        routing_class="uniform", config=cfg.model_dump(), config_hash=cfg.hash,
        fingerprint_hash=fph, status="verified", source="tune", speedup=speedup,
        noise_band=0.01, median_us=med,
    )  # fmt: skip


if __name__ == "__main__":
    main()
