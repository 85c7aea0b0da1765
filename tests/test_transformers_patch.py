"""The transformers integration on the CPU: torch implementations through the real dispatcher.

Tiny models (2 layers, hidden 64) with seeded random weights, no downloads.  A store with
verified entries choosing ``torch`` for every op key the model calls (under the dispatcher's
fingerprint) makes every decode op go through ``dispatch``; the patched model must then match
the stock one: logits within 1e-5 (float32; in practice identical) at every step, greedy tokens
identical over 64 steps on 8 prompts.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mxdb.kernels.impls import torch_impls  # noqa: E402

from mxdb.configs import config_hash  # noqa: E402
from mxdb.dispatcher import Dispatcher, DispatchOptions  # noqa: E402
from mxdb.integrations import transformers as mxt  # noqa: E402
from mxdb.models import Entry, Fingerprint  # noqa: E402
from mxdb.store import Store  # noqa: E402

FP = Fingerprint(vendor="cpu", device_name="test-cpu", mxdb="0.1")
TOL = 1e-5
STEPS = 64
BATCH = 8


def _config(kind: str) -> Any:
    common = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation="eager",
    )
    if kind == "qwen3":
        return transformers.Qwen3Config(head_dim=16, **common)
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **common
        )
    if kind == "mixtral":
        return transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
    raise ValueError(kind)


def _model(kind: str) -> Any:
    torch.manual_seed(0)
    cfg = _config(kind)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval()


def _prompts(seed: int = 1, length: int = 6) -> Any:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 96, (BATCH, length), generator=g)


def _greedy(model: Any, ids: Any, steps: int) -> tuple[Any, list[Any]]:
    """Greedy decode with the KV cache; returns tokens [B, steps] and per-step logits."""
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=steps,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    return out.sequences[:, ids.shape[1] :], list(out.logits)


def _store(tmp_path: Path) -> Store:
    return Store.open(f"sqlite:///{tmp_path / 'store.sqlite'}")


def _entries_for(router: mxt.Router, impl_of: Any = lambda op: "torch") -> list[Entry]:
    out = []
    for shape in router._shapes.values():
        if shape.op not in mxt.DECODE_OPS:
            continue
        cfg = {"impl": impl_of(shape.op, shape.family)}
        out.append(
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
    return out


def _seeded_dispatcher(tmp_path: Path, model: Any, ids: Any, impl_of: Any = None) -> Dispatcher:
    """A dispatcher whose store answers every key the model calls (learned by a first run)."""
    store = _store(tmp_path)
    store.put_fingerprint(FP)
    d = Dispatcher(store, FP, DispatchOptions(refresh_interval=60.0))
    state = mxt.patch(model, dispatcher=d)
    with torch.no_grad():
        _greedy(model, ids, STEPS)
    store.add_entries(_entries_for(state.router, impl_of or (lambda op, fam: "torch")))
    mxt.unpatch(model)
    d.refresh()
    return d


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_patched_matches_stock_over_64_steps(tmp_path: Path, kind: str) -> None:
    model = _model(kind)
    ids = _prompts()
    with torch.no_grad():
        stock_tokens, stock_logits = _greedy(model, ids, STEPS)
    d = _seeded_dispatcher(tmp_path, model, ids)
    state = mxt.patch(model, dispatcher=d)
    with torch.no_grad():
        tokens, logits = _greedy(model, ids, STEPS)
    assert len(logits) == STEPS
    for step, (a, b) in enumerate(zip(stock_logits, logits, strict=True)):
        assert (a - b).abs().max().item() <= TOL, f"step {step}"
    assert torch.equal(tokens, stock_tokens)
    calls = state.router.calls
    for op in ("rms_norm", "add_rms_norm", "rope", "masked_softmax", "swiglu"):
        if kind == "qwen3_moe" and op == "swiglu":
            continue  # every layer of this config is sparse
        assert calls[(op, "torch")] > 0, (op, dict(calls))
        assert calls[(op, "original")] == 0, (op, dict(calls))
    mxt.unpatch(model)


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_other_families_patch_and_match(tmp_path: Path, kind: str) -> None:
    model = _model(kind)
    ids = _prompts(length=5)
    with torch.no_grad():
        stock_tokens, stock_logits = _greedy(model, ids, 8)
    store = _store(tmp_path)
    d = Dispatcher(store, FP)
    state = mxt.patch(model, dispatcher=d, impls={"torch": torch_impls()})
    assert state.patched["rms_norm"] == 5 and state.patched["attention"] == 2
    assert state.patched["add_rms_norm"] == 2
    if kind == "mixtral":
        assert state.patched["moe"] == 2
    else:
        assert state.patched["swiglu"] == 2
    with torch.no_grad():
        tokens, logits = _greedy(model, ids, 8)
    assert torch.equal(tokens, stock_tokens)
    assert all(torch.equal(a, b) for a, b in zip(stock_logits, logits, strict=True))


def test_unpatch_restores_forward_identity(tmp_path: Path) -> None:
    model = _model("qwen3")
    before = {name: m.__dict__.get("forward") for name, m in model.named_modules()}
    state = mxt.patch(model, dispatcher=Dispatcher(_store(tmp_path), FP))
    patched = [m for m, _ in state.modules]
    assert len(patched) == 2 * (2 + 2) + 1 + 2 * 3  # norms (4/layer + final), layers, attn, mlp
    assert all("forward" in m.__dict__ for m in patched)
    with pytest.raises(Exception, match="already patched"):
        mxt.patch(model, dispatcher=Dispatcher(_store(tmp_path), FP))
    mxt.unpatch(model)
    after = {name: m.__dict__.get("forward") for name, m in model.named_modules()}
    assert after == before
    for m in patched:
        assert "forward" not in m.__dict__
        assert m.forward.__func__ is type(m).forward
    assert mxt.state_of(model) is None


def test_unknown_model_is_left_untouched_with_a_warning(tmp_path: Path) -> None:
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = mxt.patch(model, dispatcher=Dispatcher(_store(tmp_path), FP))
    text = " ".join(str(w.message) for w in caught)
    assert "GPT2LMHeadModel" in text and "left untouched" in text
    assert "GPT2Attention" in text and "GPT2MLP" in text
    assert state.modules == []
    assert all("forward" not in m.__dict__ for m in model.modules())
    mxt.unpatch(model)


def test_fallback_decisions_keep_original_behaviour(tmp_path: Path) -> None:
    model = _model("qwen3")
    ids = _prompts(length=4)
    with torch.no_grad():
        ref = model(ids).logits
    # an empty store: every decision is a fallback ("no_entry") -> the modules' own code
    state = mxt.patch(model, dispatcher=Dispatcher(_store(tmp_path), FP))
    with torch.no_grad():
        out = model(ids).logits
    assert torch.equal(out, ref)
    assert state.router.calls and all(impl == "original" for _, impl in state.router.calls)
    mxt.unpatch(model)


def test_dispatch_per_shape_picks_the_stored_impl(tmp_path: Path) -> None:
    model = _model("qwen3")
    ids = _prompts(length=4)
    seen: list[int] = []
    base = torch_impls()

    def marked_rms_norm(x: Any, w: Any, eps: float) -> Any:
        seen.append(x.shape[-1])
        return base["rms_norm"](x, w, eps)

    impls = {"torch": base, "fused": {**base, "rms_norm": marked_rms_norm}}

    # the store says "fused" for rms_norm over the hidden size (n=64) only, torch elsewhere
    def impl_of(op: str, family: str) -> str:
        return "fused" if (op, family) == ("rms_norm", "n64") else "torch"

    store = _store(tmp_path)
    store.put_fingerprint(FP)
    d = Dispatcher(store, FP, DispatchOptions(refresh_interval=60.0))
    state = mxt.patch(model, dispatcher=d, impls=impls, ops=["rms_norm"])
    with torch.no_grad():
        ref = model(ids).logits
    store.add_entries(_entries_for(state.router, impl_of))
    d.refresh()
    state.router.calls.clear()
    with torch.no_grad():
        out = model(ids).logits
    assert torch.equal(out, ref)
    assert seen and set(seen) == {64}  # the head-dim q/k norms (n=16) stayed on torch
    assert state.router.calls[("rms_norm", "fused")] == len(seen)
    assert state.router.calls[("rms_norm", "torch")] > 0
    assert state.patched["attention"] == 0 and state.patched["swiglu"] == 0
    mxt.unpatch(model)


# -- per-module routing caches and the fused MLP residual -----------------------------------------


def _counting_impls() -> tuple[dict[str, dict[str, Any]], list[str]]:
    """torch implementations under the name ``fused`` that record each op they run."""
    ran: list[str] = []
    base = torch_impls()

    def counted(op: str) -> Any:
        fn = base[op]

        def run(*args: Any) -> Any:
            ran.append(op)
            return fn(*args)

        return run

    return {"fused": {op: counted(op) for op in base}}, ran


@pytest.mark.parametrize("how", ["refresh", "poll", "override"])
def test_store_change_after_patching_is_seen(tmp_path: Path, how: str) -> None:
    """The per-module caches follow the dispatcher: refresh, a polled store change, overrides."""
    model = _model("qwen3")
    ids = _prompts(length=4)
    with torch.no_grad():
        ref = model(ids).logits
    store = _store(tmp_path)
    store.put_fingerprint(FP)
    interval = 0.0 if how == "poll" else 60.0
    d = Dispatcher(store, FP, DispatchOptions(refresh_interval=interval))
    impls, ran = _counting_impls()
    state = mxt.patch(model, dispatcher=d, impls=impls, ops=["rms_norm"])
    with torch.no_grad():
        model(ids)  # an empty store: every call runs the original code, and is cached so
    assert ran == [] and set(state.router.calls) == {("rms_norm", "original")}
    if how == "override":
        from mxdb.decision import Decision

        shape = next(s for s in state.router._shapes.values() if s.family == "n64")
        decision = Decision(
            config={"impl": "fused"}, level="exact", confidence=1.0, reason="exact_match"
        )
        d.set_override(shape, None, decision)
    else:
        store.add_entries(_entries_for(state.router, lambda op, fam: "fused"))
        if how == "refresh":
            d.refresh()
    state.router.calls.clear()
    with torch.no_grad():
        out = model(ids).logits
    assert torch.equal(out, ref)
    n_norms = 2 * 4 + 1
    if how == "override":  # the hidden-size norms only (2 per layer + final); q/k norms stay
        assert state.router.calls[("rms_norm", "fused")] == 5
        assert state.router.calls[("rms_norm", "original")] == n_norms - 5
        d.set_override(shape, None, None)  # cleared: seen too
        state.router.calls.clear()
        with torch.no_grad():
            model(ids)
        assert set(state.router.calls) == {("rms_norm", "original")}
    else:
        assert state.router.calls == {("rms_norm", "fused"): n_norms}
    mxt.unpatch(model)


def test_mlp_residual_fuses_with_the_next_norm(tmp_path: Path) -> None:
    """Layer i's MLP residual + layer i+1's input norm (and the last one's + the final norm)
    are one add_rms_norm; the residual stream and the logits stay exactly the stock ones."""
    model = _model("qwen3")
    ids = _prompts(length=4)
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    impls, ran = _counting_impls()
    state = mxt.patch(model, dispatcher=_ForcedTorch(), impls=impls)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    assert torch.equal(out.logits, ref.logits)
    for a, b in zip(ref.hidden_states, out.hidden_states, strict=True):
        assert torch.equal(a, b)
    layers = 2
    # two add_rms_norm per layer; hidden-size rms_norm only for layer 0's input norm
    assert ran.count("add_rms_norm") == 2 * layers
    assert state.router.calls[("add_rms_norm", "fused")] == 2 * layers
    assert ran.count("rms_norm") == 1 + 2 * layers  # + q/k norms of each layer
    mxt.unpatch(model)


def test_in_place_change_between_layers_defeats_the_handoff(tmp_path: Path) -> None:
    """A hook that edits a layer's output in place: the next norm recomputes (exactness)."""
    model = _model("qwen3")
    ids = _prompts(length=4)

    def bump(module: Any, args: Any, output: Any) -> None:
        output.mul_(1.5)

    handle = model.model.layers[0].register_forward_hook(bump)
    with torch.no_grad():
        ref = model(ids).logits
    impls, ran = _counting_impls()
    mxt.patch(model, dispatcher=_ForcedTorch(), impls=impls)
    with torch.no_grad():
        out = model(ids).logits
    assert torch.equal(out, ref)
    assert ran.count("rms_norm") == 2 + 2 * 2  # layer 0 and 1 input norms, q/k norms
    handle.remove()
    mxt.unpatch(model)


class _ForcedTorch:
    """A dispatcher answering ``fused`` for every decode op (the counting torch impls)."""

    def __init__(self) -> None:
        from mxdb.decision import Decision

        self.decision = Decision(
            config={"impl": "fused"}, level="exact", confidence=1.0, reason="exact_match"
        )

    def dispatch(self, shape: Any, routing: Any = None) -> Any:
        return self.decision


def test_known_model_without_the_asked_op_says_so(tmp_path: Path) -> None:
    model = _model("qwen3_moe")  # every layer of this config is sparse: no gated MLP
    with pytest.warns(UserWarning, match="no module for the ops asked for"):
        state = mxt.patch(model, dispatcher=Dispatcher(_store(tmp_path), FP), ops=["swiglu"])
    assert not state.modules
    mxt.unpatch(model)
