"""Eager decode tokens/s and kernel launches per token, stock vs patched (GPU).

Builds, from configs with seeded random weights (no downloads), a Qwen3-0.6B-sized dense model
and a small Qwen3-MoE model (bf16, ``attn_implementation="eager"``), and decodes ``--steps``
tokens for a batch of ``--batch`` prompts with the KV cache, in eager mode, for each variant:

- ``stock``: the unpatched model;
- one variant per op (``rms_norm``, ``add_rms_norm``, ``rope``, ``masked_softmax``, ``swiglu``,
  and ``moe`` for the MoE model): that op alone routed through mxdb;
- ``all``: every op routed.

Routed ops run the fused Triton kernels (``--impl``; default ``fused``) through a dispatcher:
``--db URL`` uses a store's verified entries (``mxdb.tune.decode``) under this host's
fingerprint; without it every decision is forced to ``--impl``.  Each decode step is timed
(wall clock, synchronized); launches are counted with the torch profiler (CUDA kernel launch
calls) over ``--profile-steps`` steps.  The raw figures go into an audited evidence bundle
(``mxdb.decode``, see :mod:`mxdb.evidence.decode`) in ``--out``.  Target (dense, ``all``):
>= 1.5x tokens/s, <= 0.5x launches per token.

    python benchmarks/decode_ops.py --out evidence/h200-decode-ops
    mxdb audit evidence/h200-decode-ops
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from mxdb.decision import Decision
from mxdb.evidence.decode import model_doc, write_decode_bundle

LAUNCH_NAMES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


class Forced:
    """A dispatcher that answers every decode op with one implementation."""

    def __init__(self, impl: str) -> None:
        self.decision = Decision(
            config={"impl": impl}, level="exact", confidence=1.0, reason="exact_match"
        )

    def dispatch(self, shape: Any, routing: Any = None) -> Decision:
        if shape.op == "fused_moe":
            from mxdb.decision import fallback

            return fallback("no_entry")
        return self.decision


def dense_config() -> Any:
    import transformers

    return transformers.Qwen3Config(  # type: ignore[call-arg]
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
        tie_word_embeddings=True, attn_implementation="eager",
    )  # fmt: skip


def moe_config() -> Any:
    import transformers

    return transformers.Qwen3MoeConfig(  # type: ignore[call-arg]
        vocab_size=32000, hidden_size=1024, intermediate_size=3072, moe_intermediate_size=384,
        num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        num_experts=32, num_experts_per_tok=4, max_position_embeddings=4096,
        attn_implementation="eager",
    )  # fmt: skip


def build(cfg: Any, dtype: torch.dtype) -> Any:
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    return model.to("cuda").eval()


@torch.no_grad()
def decode(model: Any, ids: torch.Tensor, steps: int) -> tuple[list[float], list[torch.Tensor]]:
    """Prefill, then ``steps`` greedy decode steps; wall seconds and logits of each step."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(ids, past_key_values=cache, use_cache=True)
    tok = out.logits[:, -1:].argmax(-1)
    times, logits = [], []
    pos = ids.shape[1]
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(
            tok,
            past_key_values=cache,
            use_cache=True,
            cache_position=torch.tensor([pos], device=ids.device),
        )
        tok = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        logits.append(out.logits[:, -1].float())
        pos += 1
    return times, logits


@torch.no_grad()
def count_launches(model: Any, ids: torch.Tensor, steps: int) -> int:
    from torch.profiler import ProfilerActivity, profile

    decode(model, ids, 2)  # warm (compilation, caches) outside the profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        decode(model, ids, steps)
    launches = sum(e.count for e in prof.key_averages() if e.key in LAUNCH_NAMES)
    # prefill is in the profile too: subtract one profiled prefill
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof0:
        decode(model, ids, 0)
    launches -= sum(e.count for e in prof0.key_averages() if e.key in LAUNCH_NAMES)
    return int(launches)


class ShapeRecorder:
    """A dispatcher that answers every call with a fallback and remembers the decode op shapes."""

    def __init__(self) -> None:
        self.shapes: set[Any] = set()

    def dispatch(self, shape: Any, routing: Any = None) -> Decision:
        from mxdb.decision import fallback

        if shape.op != "fused_moe":
            self.shapes.add(shape)
        return fallback("no_entry")


def decode_cases(model: Any, ids: torch.Tensor, steps: int) -> list[Any]:
    """The decode-op shapes ``model`` asks for over ``steps`` decode steps (every op patched)."""
    from mxdb.decode_rule import DecodeCase
    from mxdb.integrations import transformers as mxt

    rec = ShapeRecorder()
    mxt.patch(model, dispatcher=rec)
    try:
        decode(model, ids, steps)
    finally:
        mxt.unpatch(model)
    out = []
    for s in sorted(rec.shapes):
        dims = type(s).__getnewargs__(s)[1]
        out.append(DecodeCase(s.op, dims, s.tokens, s.dtype))
    return out


def run_model(
    name: str, cfg: Any, args: argparse.Namespace, dispatcher: Any
) -> tuple[dict[str, Any], list[Any]]:
    """Time every variant (interleaved rounds), then count launches; the model doc and cases."""
    from mxdb.integrations import transformers as mxt

    dtype = torch.bfloat16
    model = build(cfg, dtype)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt_len), generator=g).cuda()
    is_moe = "moe" in name
    ops = ["rms_norm", "add_rms_norm", "rope", "masked_softmax", "swiglu"]
    if is_moe:
        ops.append("moe")
    variants_ops = [("stock", []), *((op, [op]) for op in ops), ("all", ops)]
    cases: list[Any] = []
    if args.tune is not None:
        from mxdb.kernels.decode_backend import DecodeGpuBackend

        from mxdb.tune.decode import to_json, tune_decode

        cases = decode_cases(model, ids, args.steps)
        t0 = time.perf_counter()
        results = tune_decode(
            DecodeGpuBackend(0, method="eager"), cases, dispatcher.store, reps=args.tune_reps
        )
        print(f"{name}: tuned {len(cases)} decode shapes in {time.perf_counter() - t0:.1f} s")
        for r in results:
            print("  ", json.dumps(to_json(r)), flush=True)
        dispatcher.refresh()
        cases = results
    decode(model, ids, 4)  # warm up the stock model
    stock_logits: list[torch.Tensor] = []
    times: dict[str, list[float]] = {v: [] for v, _ in variants_ops}
    diffs: dict[str, float] = {}
    per_round = max(1, args.steps // args.rounds)
    # Rounds of every variant in turn, so that a drift of the machine touches all alike.
    for rnd in range(args.rounds):
        for vname, vops in variants_ops:
            if vops:
                mxt.patch(model, dispatcher=dispatcher, ops=vops)
            try:
                if rnd == 0:
                    decode(model, ids, 4)  # compile and record the kernels
                t, logits = decode(model, ids, per_round)
            finally:
                if vops:
                    mxt.unpatch(model)
            times[vname] += t
            if not vops and rnd == 0:
                stock_logits = logits
            elif rnd == 0:
                diffs[vname] = max(
                    (a - b).abs().max().item() for a, b in zip(stock_logits, logits, strict=True)
                )
    variants = []
    for vname, vops in variants_ops:
        if vops:
            mxt.patch(model, dispatcher=dispatcher, ops=vops)
        try:
            launches = count_launches(model, ids, args.profile_steps)
        finally:
            if vops:
                mxt.unpatch(model)
        t = times[vname]
        variants.append(
            {
                "name": vname,
                "ops": vops,
                "step_s": t,
                "launches": launches,
                "profiled_steps": args.profile_steps,
                "max_abs_logit_diff": diffs.get(vname) if vops else None,
            }
        )
        print(
            f"{name:10s} {vname:15s} {args.batch / sorted(t)[len(t) // 2]:9.1f} tok/s "
            f"{launches / args.profile_steps:8.1f} launches/step  "
            f"max|dlogit| {diffs.get(vname, 0.0):.4f}",
            flush=True,
        )
    config = {k: getattr(cfg, k) for k in ("hidden_size", "num_hidden_layers", "vocab_size")}
    config["moe"] = is_moe
    doc = model_doc(
        name=name,
        config=config,
        dtype="bf16",
        batch=args.batch,
        prompt_len=args.prompt_len,
        variants=variants,
    )
    del model
    torch.cuda.empty_cache()
    return doc, cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="evidence bundle directory (new)")
    ap.add_argument(
        "--tune",
        default=None,
        metavar="URL",
        help="tune every decode shape the models ask for into this store first, then dispatch "
        "from it (the per-shape choice); without it every op is forced to --impl",
    )
    ap.add_argument("--tune-reps", type=int, default=30, help="timed samples per candidate")
    ap.add_argument("--impl", default="fused", choices=["fused", "flaggems", "torch"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps per variant")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds the steps split into")
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument("--models", default="dense,moe")
    args = ap.parse_args()

    from mxdb.kernels.live import live_fingerprint_components

    from mxdb.fingerprint import collect

    fp = collect(live_fingerprint_components(0))
    if args.tune:
        from mxdb.dispatcher import Dispatcher
        from mxdb.store import Store

        dispatcher: Any = Dispatcher(Store.open(args.tune), fp)
    else:
        dispatcher = Forced(args.impl)
    models, cases = [], []
    wanted = set(args.models.split(","))
    built = [("qwen3-0.6b-random", dense_config), ("qwen3-moe-small-random", moe_config)]
    for name, make in built:
        if ("moe" if "moe" in name else "dense") in wanted:
            doc, tuned = run_model(name, make(), args, dispatcher)
            models.append(doc)
            cases += tuned
    from mxdb.kernels.decode_ops import launch_paths

    from mxdb.evidence.decode import case_doc

    print("launch paths:", json.dumps(launch_paths(), default=str))
    root = write_decode_bundle(
        args.out,
        fingerprint=fp,
        milestone="decode-ops",
        cases=[case_doc(r) for r in cases],
        models=models,
    )
    for m in models:
        print(m["name"], json.dumps(m["claims"].get("all")), "meets_target:", m["meets_target"])
    print(f"wrote {root}; audit it with: mxdb audit {root}")


if __name__ == "__main__":
    main()
