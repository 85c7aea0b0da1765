"""Host cost of the transformers patch's per-call Python path (CPU, no GPU needed).

Usage: python benchmarks/bench_patch_host.py [--calls N] [--tokens 1,4,8]
       [--out benchmarks/results/patch_host.json]

Decode-shaped modules of a Qwen3-0.6B-sized layer (hidden 1024, 16 query / 8 key-value heads,
head dim 128, intermediate 3072; bf16 CPU tensors, ``tokens`` rows of one position each) are
called through their forward:

- ``stock``: the module's own forward (real torch ops, for reference);
- ``patched``: the forward ``mxdb.integrations.transformers.patch`` installs, routed through a
  real :class:`~mxdb.dispatcher.Dispatcher` over a SQLite store whose verified entries choose
  ``fused`` for every key, where ``fused`` is a stand-in that does nothing but return
  preallocated outputs.  What is measured is the patch's own Python path: argument handling,
  shape keys, dispatch, routing to the implementation.

The modules the patched forwards call but that are not the op being measured (projections,
the attention's q/k norms, the layer's attention and MLP) are stand-ins returning preallocated
outputs in both variants, so each row isolates one op:

- ``rms_norm``: an RMSNorm over the hidden size (and ``rms_norm_head`` over the head dim);
- ``add_rms_norm``: a decoder layer (residual add + post-attention norm, and the MLP residual);
- ``rope``: an attention (``sdpa``, one key) with ``rope`` routed;
- ``rope+masked_softmax``: an eager attention with both routed;
- ``swiglu``: a gated MLP.

Per-call microseconds are the best of 5 repeats of ``--calls`` calls; the JSON is written
atomically.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from mxdb.kernels.impls import torch_impls

from mxdb.configs import config_hash
from mxdb.dispatcher import Dispatcher, DispatchOptions
from mxdb.fileio import atomic_write_text
from mxdb.integrations import transformers as mxt
from mxdb.models import Entry, Fingerprint
from mxdb.store import Store

FP = Fingerprint(vendor="cpu", device_name="bench-cpu", mxdb="0.1")
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 1024, 16, 8, 128, 3072
DTYPE = torch.bfloat16


class Stub(torch.nn.Module):
    """A module whose forward returns a preallocated output (a projection, a sub-block)."""

    def __init__(self, out: Any) -> None:
        super().__init__()
        self.out = out

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.out


class StubLinear(Stub):
    """A projection stand-in with the ``out_features`` the patched MLP reads."""

    def __init__(self, out_features: int, out: Any) -> None:
        super().__init__(out)
        self.out_features = out_features


def stand_in_impls(b: int) -> dict[str, Any]:
    """``fused`` implementations that return preallocated outputs of the right shapes."""
    hid = torch.zeros(b, 1, HIDDEN, dtype=DTYPE)
    head = torch.zeros(b, 1, HEADS, HEAD_DIM, dtype=DTYPE)
    q = torch.zeros(b, HEADS, 1, HEAD_DIM, dtype=DTYPE)
    k = torch.zeros(b, KV_HEADS, 1, HEAD_DIM, dtype=DTYPE)
    probs = torch.zeros(b, HEADS, 1, 1, dtype=DTYPE)
    inter = torch.zeros(b, 1, INTER, dtype=DTYPE)

    def rms_norm(x: Any, w: Any, eps: float) -> Any:
        return hid if x.shape[-1] == HIDDEN else head

    def add_rms_norm(x: Any, r: Any, w: Any, eps: float) -> Any:
        return hid, hid

    def rope(qq: Any, kk: Any, c: Any, s: Any) -> Any:
        return q, k

    def masked_softmax(sc: Any, m: Any, scale: float) -> Any:
        return probs

    def swiglu(g: Any, u: Any) -> Any:
        return inter

    return {
        "rms_norm": rms_norm,
        "add_rms_norm": add_rms_norm,
        "rope": rope,
        "masked_softmax": masked_softmax,
        "swiglu": swiglu,
    }


def config(attn: str) -> Any:
    return transformers.Qwen3Config(  # type: ignore[call-arg]
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=256, attn_implementation=attn,
    )  # fmt: skip


def model(attn: str) -> Any:
    torch.manual_seed(0)
    m = transformers.Qwen3ForCausalLM(config(attn)).to(DTYPE).eval()
    return m


def stub_modules(m: Any, b: int) -> None:
    """Projections, q/k norms, attention and MLP blocks as stand-ins (see the module doc)."""
    hid = torch.zeros(b, 1, HIDDEN, dtype=DTYPE)
    for layer in m.model.layers:
        a = layer.self_attn
        a.q_proj = Stub(torch.zeros(b, 1, HEADS * HEAD_DIM, dtype=DTYPE))
        a.k_proj = Stub(torch.zeros(b, 1, KV_HEADS * HEAD_DIM, dtype=DTYPE))
        a.v_proj = Stub(torch.zeros(b, 1, KV_HEADS * HEAD_DIM, dtype=DTYPE))
        a.o_proj = Stub(hid)
        a.q_norm = Stub(torch.zeros(b, 1, HEADS, HEAD_DIM, dtype=DTYPE))
        a.k_norm = Stub(torch.zeros(b, 1, KV_HEADS, HEAD_DIM, dtype=DTYPE))
        mlp = layer.mlp
        mlp.gate_proj = StubLinear(INTER, torch.zeros(b, 1, INTER, dtype=DTYPE))
        mlp.up_proj = Stub(torch.zeros(b, 1, INTER, dtype=DTYPE))
        mlp.down_proj = Stub(hid)


def timed(fn: Callable[[], Any], calls: int) -> float:
    """Best per-call microseconds over 5 repeats."""
    for _ in range(min(calls, 200)):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / calls)
    return best / 1000.0


def seeded_dispatcher(root: Path, m: Any, calls: list[Callable[[], Any]], ops: list[str]) -> Any:
    """A dispatcher whose store answers ``fused`` for every key ``calls`` ask (learned first)."""
    store = Store.open(f"sqlite:///{root / 'store.sqlite'}")
    store.put_fingerprint(FP)
    d = Dispatcher(store, FP, DispatchOptions(refresh_interval=60.0))
    state = mxt.patch(m, dispatcher=d, ops=ops, impls={"torch": torch_impls()})
    with torch.no_grad():
        for c in calls:
            c()
    entries = []
    for shape in state.router._shapes.values():
        cfg = {"impl": "fused"}
        entries.append(
            Entry(
                op=shape.op,
                dtype=shape.dtype,
                family=shape.family,
                dims={"tokens": shape.tokens},
                tokens=shape.tokens,
                routing_class="uniform",
                config=cfg,
                config_hash=config_hash(cfg),
                fingerprint_hash=FP.hash,
                status="verified",
                source="tune",
                speedup=1.0,
                noise_band=0.01,
            )
        )
    store.add_entries(entries)
    mxt.unpatch(m)
    d.refresh()
    return d


def cases(m: Any, b: int) -> dict[str, tuple[list[str], Callable[[], Any]]]:
    layer = m.model.layers[0]
    attn = layer.self_attn
    x = torch.randn(b, 1, HIDDEN, dtype=DTYPE)
    xh = torch.randn(b, 1, HEADS, HEAD_DIM, dtype=DTYPE)
    pos = torch.zeros(b, 1, dtype=torch.long)
    cos_sin = m.model.rotary_emb(x, pos)
    head_norm = transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm(HEAD_DIM).to(DTYPE)
    m.model.extra_head_norm = head_norm  # a module patch() finds (a q/k norm stand-in)
    layer_stub = m.model.layers[1]
    layer_stub.input_layernorm = Stub(x)
    layer_stub.self_attn = Stub((x, None))
    layer_stub.mlp = Stub(x)
    return {
        "rms_norm": (["rms_norm"], lambda: m.model.norm(x)),
        "rms_norm_head": (["rms_norm"], lambda: head_norm(xh)),
        "add_rms_norm": (
            ["add_rms_norm"],
            lambda: layer_stub(x, attention_mask=None, position_embeddings=cos_sin),
        ),
        "rope": (["rope"], lambda: attn(x, position_embeddings=cos_sin, attention_mask=None)),
        "swiglu": (["swiglu"], lambda: layer.mlp(x)),
    }


def bench_tokens(b: int, calls: int, root: Path) -> list[dict[str, Any]]:
    rows = []
    for attn_impl, names in (("sdpa", None), ("eager", ("rope+masked_softmax",))):
        m = model(attn_impl)
        stub_modules(m, b)
        cs = cases(m, b)
        if names is not None:
            cs = {"rope+masked_softmax": (["rope", "masked_softmax"], cs["rope"][1])}
        for name, (ops, call) in cs.items():
            with torch.no_grad():
                stock = timed(call, calls)
                sub = root / f"{name}-{b}"
                sub.mkdir(parents=True, exist_ok=True)
                d = seeded_dispatcher(sub, m, [call], ops)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    state = mxt.patch(m, dispatcher=d, ops=ops, impls={"fused": stand_in_impls(b)})
                call()
                patched = timed(call, calls)
                routed = {f"{op}:{impl}": n for (op, impl), n in state.router.calls.items()}
                mxt.unpatch(m)
            assert all(k.endswith(":fused") for k in routed), routed
            rows.append(
                {
                    "op": name,
                    "tokens": b,
                    "stock_us": round(stock, 3),
                    "patched_us": round(patched, 3),
                    "routed": sorted(routed),
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--tokens", default="1,4,8")
    ap.add_argument("--label", default="", help="a label stored with the results")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/patch_host.json"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for b in (int(t) for t in a.tokens.split(",")):
            rows += bench_tokens(b, a.calls, Path(tmp))
    doc = {
        "benchmark": "patch_host",
        "label": a.label,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "calls": a.calls,
        "results": rows,
    }
    print(f"{'op':22s} {'tokens':>6s} {'stock us':>9s} {'patched us':>11s}")
    for r in rows:
        print(f"{r['op']:22s} {r['tokens']:6d} {r['stock_us']:9.2f} {r['patched_us']:11.2f}")
    atomic_write_text(a.out, json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
