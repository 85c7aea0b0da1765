"""A patched Qwen3-MoE model with the FlagGems hook installed (GPU): its MoE blocks go through
the hook (dispatch, routing monitor, healing samples, lean layer) and the greedy decode matches
the unpatched model's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mxdb.dispatcher import Dispatcher, DispatchOptions
from mxdb.models import Fingerprint
from mxdb.runtime.healing import HealingOptions
from mxdb.store import Store

pytestmark = pytest.mark.gpu

FP = Fingerprint(vendor="nvidia", device_name="test-gpu", mxdb="0.1")


def _model(torch: Any, transformers: Any) -> Any:
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_experts=16, num_experts_per_tok=4, max_position_embeddings=256,
        attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    return model.eval()


def _decode(torch: Any, model: Any, steps: int) -> tuple[list[Any], list[Any]]:
    from transformers import DynamicCache

    g = torch.Generator(device="cuda").manual_seed(1)
    tok = torch.randint(0, 512, (4, 1), generator=g, device="cuda")
    cache = DynamicCache(config=model.config)
    toks, logits = [], []
    with torch.no_grad():
        for pos in range(steps):
            out = model(tok, past_key_values=cache, use_cache=True,
                        cache_position=torch.arange(pos, pos + 1, device="cuda"))  # fmt: skip
            tok = out.logits[:, -1:].argmax(-1)
            toks.append(tok)
            logits.append(out.logits[:, -1].float())
    return toks, logits


def test_patched_model_calls_the_installed_hook(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("flag_gems")
    import mxdb
    from mxdb.integrations import transformers as mxt

    model = _model(torch, transformers)
    _, stock = _decode(torch, model, 6)
    store = Store.open(f"sqlite:///{tmp_path / 'db.sqlite'}")
    store.put_fingerprint(FP)
    d = Dispatcher(store, FP, DispatchOptions(refresh_interval=0))
    state = mxt.patch(model, dispatcher=d, ops=["moe"])
    hook = mxdb.install(d, monitor_every=2, healing=HealingOptions(sample_every=3))
    try:
        _, ours = _decode(torch, model, 6)
        stats = hook.stats()
    finally:
        mxdb.uninstall()
        mxt.unpatch(model)
    assert state.router.calls[("moe", "hook")] == 2 * 6
    assert stats["calls"] == 2 * 6
    assert stats["lean_fallback"] == 2 * 6  # an empty store: FlagGems' choice, lean layer
    assert stats["monitor_copies"] >= 5
    diff = max(float((a - b).abs().max()) for a, b in zip(stock, ours, strict=True))
    scale = max(float(a.abs().max()) for a in stock)
    assert diff <= 0.05 * scale, (diff, scale)
