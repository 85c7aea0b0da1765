"""Route a Hugging Face ``transformers`` model's decode ops through the mxdb dispatcher.

``patch(model)`` (explicit, opt-in) replaces, on the model's own module instances, the forward
of:

- every RMSNorm (``LlamaRMSNorm``, ``Qwen3RMSNorm``, ``Qwen3MoeRMSNorm``, ``MixtralRMSNorm``,
  the Qwen3 q/k norms included): op ``rms_norm``, dims ``{n}``;
- every decoder layer (``LlamaDecoderLayer``, ``Qwen3DecoderLayer``, ``Qwen3MoeDecoderLayer``,
  ``MixtralDecoderLayer``): the attention's residual add and the post-attention RMSNorm become
  one ``add_rms_norm`` (dims ``{n}``);
- every attention (``LlamaAttention``, ``Qwen3Attention``, ``Qwen3MoeAttention``,
  ``MixtralAttention``): ``apply_rotary_pos_emb`` becomes op ``rope`` (dims ``{hq, hk, d}``),
  and, under ``attn_implementation="eager"``, the scale + mask + float32 softmax of
  ``eager_attention_forward`` becomes op ``masked_softmax`` (dims ``{h, k}``, ``k`` the key
  length rounded up to a power of two, so that a growing KV cache keeps one key per bucket);
- every gated MLP with a SiLU activation (``LlamaMLP``, ``Qwen3MLP``, ``Qwen3MoeMLP``):
  ``silu(gate) * up`` becomes op ``swiglu`` (dims ``{n}`` = intermediate size);
- every sparse MoE block (``Qwen3MoeSparseMoeBlock``, ``MixtralSparseMoeBlock``): the experts
  run through mxdb's MoE layer (``mxdb.kernels.layer.MoELayer``) with the dispatched config.

Each call asks ``dispatcher.dispatch(OpShape(op, dims, rows, dtype), None)`` (a cached dict
lookup).  The decision's ``config["impl"]`` (``fused``, ``flaggems`` or ``torch``) picks the
implementation from :mod:`mxdb.integrations.impls`; a fallback decision, or an implementation
not usable in this process, runs the module's original code.  ``unpatch(model)`` restores
every module exactly (the instance attributes are removed, the class's forward answers again).
Models of other families are left untouched, with a warning naming what was skipped.
"""

from __future__ import annotations

import importlib
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from mxdb.errors import UsageError
from mxdb.integrations.impls import DECODE_OPS
from mxdb.shapes import MoEShape, OpShape, canonical_dtype

#: Every op ``patch`` can route (the decode ops and the MoE block).
ALL_OPS: tuple[str, ...] = (*DECODE_OPS, "moe")
_ATTR = "_mxdb_patch"


@dataclass(frozen=True)
class Family:
    """The module classes of one model family in ``transformers``."""

    module: str
    norm: str
    attention: str
    layer: str
    mlp: str | None = None
    moe: str | None = None
    #: where the attention's sliding window comes from: the module ("attr"), config or nowhere
    sliding: str | None = None


FAMILIES: dict[str, Family] = {
    "llama": Family(
        "transformers.models.llama.modeling_llama",
        "LlamaRMSNorm",
        "LlamaAttention",
        "LlamaDecoderLayer",
        mlp="LlamaMLP",
    ),
    "qwen3": Family(
        "transformers.models.qwen3.modeling_qwen3",
        "Qwen3RMSNorm",
        "Qwen3Attention",
        "Qwen3DecoderLayer",
        mlp="Qwen3MLP",
        sliding="attr",
    ),
    "qwen3_moe": Family(
        "transformers.models.qwen3_moe.modeling_qwen3_moe",
        "Qwen3MoeRMSNorm",
        "Qwen3MoeAttention",
        "Qwen3MoeDecoderLayer",
        mlp="Qwen3MoeMLP",
        moe="Qwen3MoeSparseMoeBlock",
        sliding="attr",
    ),
    "mixtral": Family(
        "transformers.models.mixtral.modeling_mixtral",
        "MixtralRMSNorm",
        "MixtralAttention",
        "MixtralDecoderLayer",
        moe="MixtralSparseMoeBlock",
        sliding="config",
    ),
}


@dataclass
class PatchState:
    """What ``patch`` changed on one model, to undo it and to count what ran."""

    router: Router
    #: (module, the instance's own ``forward`` before patching, or None)
    modules: list[tuple[Any, Any]] = field(default_factory=list)
    patched: Counter[str] = field(default_factory=Counter)
    skipped: list[str] = field(default_factory=list)


class Router:
    """Per-call choice of implementation: one cached dispatch per call, no allocation."""

    def __init__(self, dispatcher: Any, ops: Iterable[str], impls: dict[str, dict[str, Any]]):
        self.dispatcher = dispatcher
        self.ops = frozenset(ops)
        self.impls = impls
        self._shapes: dict[tuple[Any, ...], Any] = {}
        self._dtypes: dict[Any, str] = {}
        #: (op, impl) -> calls; impl "original" for fallbacks and unusable implementations
        self.calls: Counter[tuple[str, str]] = Counter()

    def dtype(self, torch_dtype: Any) -> str:
        name = self._dtypes.get(torch_dtype)
        if name is None:
            name = canonical_dtype(str(torch_dtype))
            self._dtypes[torch_dtype] = name
        return name

    def impl(self, op: str, dims: tuple[tuple[str, int], ...], rows: int, dtype: Any) -> Any:
        """The implementation to run, or None for the module's original code."""
        key = (op, dims, rows, dtype)
        shape = self._shapes.get(key)
        if shape is None:
            shape = OpShape(op, dict(dims), max(1, rows), self.dtype(dtype))
            self._shapes[key] = shape
        decision = self.dispatcher.dispatch(shape, None)
        config = decision.config
        fn = None
        name = "original"
        if config is not None:
            chosen = config.get("impl")
            fn = self.impls.get(chosen, {}).get(op)
            if fn is not None:
                name = chosen
        self.calls[(op, name)] += 1
        return fn

    def moe_decision(self, block: Any, rows: int, dtype: Any) -> Any:
        e, two_i, h = block.experts.gate_up_proj.shape
        key = ("moe", e, h, two_i, rows, dtype)
        shape = self._shapes.get(key)
        if shape is None:
            topk = _topk(block)
            shape = MoEShape(e, h, two_i // 2, topk, max(1, rows), self.dtype(dtype))
            self._shapes[key] = shape
        return self.dispatcher.dispatch(shape, None)


def _topk(block: Any) -> int:
    return int(getattr(block, "top_k", None) or block.gate.top_k)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _module_classes(family: Family) -> dict[str, type]:
    mod = importlib.import_module(family.module)
    out = {}
    for role in ("norm", "attention", "layer", "mlp", "moe"):
        name = getattr(family, role)
        if name is not None:
            out[role] = getattr(mod, name)
    return out


def _original(module: Any) -> Any:
    """The forward the module runs now (its own instance attribute, or the class's, bound)."""
    own = module.__dict__.get("forward")
    return own if own is not None else type(module).forward.__get__(module)


def _set_forward(state: PatchState, module: Any, fwd: Callable[..., Any], role: str) -> None:
    state.modules.append((module, module.__dict__.get("forward")))
    module.forward = fwd
    state.patched[role] += 1


# -- per-role forwards --------------------------------------------------------------------------


def _norm_forward(router: Router, norm: Any) -> Callable[..., Any]:
    orig = _original(norm)

    def forward(hidden_states: Any) -> Any:
        n = hidden_states.shape[-1]
        fn = router.impl("rms_norm", (("n", n),), hidden_states.numel() // n, hidden_states.dtype)
        if fn is None:
            return orig(hidden_states)
        return fn(hidden_states, norm.weight, norm.variance_epsilon)

    return forward


def _layer_forward(router: Router, layer: Any) -> Callable[..., Any]:
    orig = _original(layer)

    def forward(hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        if args:  # positional arguments: a caller we do not know; keep the original code
            return orig(hidden_states, *args, **kwargs)
        if "past_key_values" in kwargs and "cache" not in kwargs:
            kwargs["cache"] = kwargs.pop("past_key_values")
        residual = hidden_states
        h = layer.input_layernorm(hidden_states)
        h, _ = layer.self_attn(hidden_states=h, **kwargs)
        post = layer.post_attention_layernorm
        n = h.shape[-1]
        fn = router.impl("add_rms_norm", (("n", n),), h.numel() // n, h.dtype)
        if fn is None:
            h = residual + h
            residual = h
            h = post(h)
        else:
            h, residual = fn(h, residual, post.weight, post.variance_epsilon)
        h = layer.mlp(h)
        return residual + h

    return forward


def _attention_forward(
    router: Router, attn: Any, family: Family, modeling: Any
) -> Callable[..., Any]:
    import torch

    def eager(
        module: Any,
        query: Any,
        key: Any,
        value: Any,
        attention_mask: Any,
        scaling: float,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> Any:
        bsz, heads, sq, _ = query.shape
        fn = router.impl(
            "masked_softmax",
            (("h", heads), ("k", _pow2(key.shape[-2]))),
            bsz * sq,
            query.dtype,
        )
        if fn is None:
            return modeling.eager_attention_forward(
                module,
                query,
                key,
                value,
                attention_mask,
                scaling=scaling,
                dropout=dropout,
                **kwargs,
            )
        key_states = modeling.repeat_kv(key, module.num_key_value_groups)
        value_states = modeling.repeat_kv(value, module.num_key_value_groups)
        scores = torch.matmul(query, key_states.transpose(2, 3))
        probs = fn(scores, attention_mask, scaling)
        probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
        out = torch.matmul(probs, value_states).transpose(1, 2).contiguous()
        return out, probs

    def forward(
        hidden_states: Any,
        position_embeddings: Any = None,
        attention_mask: Any = None,
        cache: Any = None,
        **kwargs: Any,
    ) -> Any:
        if "past_key_values" in kwargs and cache is None:
            cache = kwargs.pop("past_key_values")
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, attn.head_dim)
        q = attn.q_proj(hidden_states).view(hidden_shape)
        k = attn.k_proj(hidden_states).view(hidden_shape)
        if hasattr(attn, "q_norm"):
            q = attn.q_norm(q)
            k = attn.k_norm(k)
        q = q.transpose(1, 2)
        k = k.transpose(1, 2)
        v = attn.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        fn = None
        if "rope" in router.ops:
            dims = (("d", q.shape[-1]), ("hk", k.shape[1]), ("hq", q.shape[1]))
            fn = router.impl("rope", dims, q.shape[0] * q.shape[2], q.dtype)
        if fn is None:
            q, k = modeling.apply_rotary_pos_emb(q, k, cos, sin)
        else:
            q, k = fn(q, k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, attn.layer_idx, kwargs=kwargs)
        impl = attn.config._attn_implementation
        if impl == "eager" and "masked_softmax" in router.ops:
            interface: Callable[..., Any] = eager
        else:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            interface = ALL_ATTENTION_FUNCTIONS.get_interface(
                impl, modeling.eager_attention_forward
            )
        extra: dict[str, Any] = {}
        if family.sliding == "attr":
            extra["sliding_window"] = attn.sliding_window
        elif family.sliding == "config":
            extra["sliding_window"] = getattr(attn.config, "sliding_window", None)
        out, weights = interface(
            attn,
            q,
            k,
            v,
            attention_mask,
            dropout=0.0 if not attn.training else attn.attention_dropout,
            scaling=attn.scaling,
            **extra,
            **kwargs,
        )
        out = out.reshape(*input_shape, -1).contiguous()
        return attn.o_proj(out), weights

    return forward


def _mlp_forward(router: Router, mlp: Any) -> Callable[..., Any]:
    orig = _original(mlp)

    def forward(x: Any) -> Any:
        n = mlp.gate_proj.out_features
        fn = router.impl("swiglu", (("n", n),), x.numel() // x.shape[-1], x.dtype)
        if fn is None:
            return orig(x)
        return mlp.down_proj(fn(mlp.gate_proj(x), mlp.up_proj(x)))

    return forward


def _moe_usable() -> bool:
    from mxdb.integrations.impls import flaggems_usable, fused_usable

    return fused_usable() and flaggems_usable()


def _moe_forward(router: Router, block: Any) -> Callable[..., Any]:
    orig = _original(block)
    layers: dict[Any, Any] = {}

    def forward(hidden_states: Any) -> Any:
        bsz, seq, hidden = hidden_states.shape
        decision = router.moe_decision(block, bsz * seq, hidden_states.dtype)
        if decision.config is None or not hidden_states.is_cuda or not _moe_usable():
            router.calls[("moe", "original")] += 1
            return orig(hidden_states)
        import torch

        x = hidden_states.reshape(-1, hidden)
        _, weights, ids = block.gate(x)
        key = hidden_states.dtype
        layer = layers.get(key)
        if layer is None:
            from mxdb.kernels.layer import MoELayer, dispatch_config_for

            experts = block.experts
            layer = MoELayer(experts.gate_up_proj, experts.down_proj, _topk(block))
            layer.config_for = dispatch_config_for(layer.family_shape, router.dispatcher)
            layers[key] = layer
        out = layer(
            x.contiguous(), weights.to(torch.float32), ids.to(torch.int32).contiguous()
        ).clone()
        router.calls[("moe", "mxdb")] += 1
        return out.view(bsz, seq, hidden)

    return forward


# -- public API ---------------------------------------------------------------------------------


def _default_dispatcher() -> Any:
    from mxdb.dispatcher import default_dispatcher

    return default_dispatcher()


def patch(
    model: Any,
    *,
    dispatcher: Any = None,
    ops: Iterable[str] | None = None,
    impls: dict[str, dict[str, Any]] | None = None,
) -> PatchState:
    """Route ``model``'s decode ops (``ops``, default all of ``ALL_OPS``) through ``dispatcher``.

    ``dispatcher`` defaults to the process-wide one (``mxdb.configure``); ``impls`` to the
    implementations usable here (:func:`mxdb.integrations.impls.available`).  Returns the
    patch state (also kept on the model): ``state.router.calls`` counts what ran.  Patching a
    patched model raises; ``unpatch`` first.
    """
    if getattr(model, _ATTR, None) is not None:
        raise UsageError("this model is already patched by mxdb; call unpatch(model) first")
    chosen = tuple(ops) if ops is not None else ALL_OPS
    unknown = sorted(set(chosen) - set(ALL_OPS))
    if unknown:
        raise UsageError(f"unknown ops {unknown}; choose from {', '.join(ALL_OPS)}")
    if impls is None:
        from mxdb.integrations.impls import available

        impls = available()
    router = Router(dispatcher if dispatcher is not None else _default_dispatcher(), chosen, impls)
    state = PatchState(router)
    roles: dict[type, tuple[str, Family, Any]] = {}
    for family in FAMILIES.values():
        try:
            classes = _module_classes(family)
        except (ImportError, AttributeError):
            continue
        modeling = importlib.import_module(family.module)
        for role, cls in classes.items():
            roles[cls] = (role, family, modeling)
    for name, module in model.named_modules():
        hit = roles.get(type(module))
        if hit is None:
            if name and _looks_relevant(module):
                state.skipped.append(f"{name} ({type(module).__name__})")
            continue
        role, family, modeling = hit
        if role == "norm" and "rms_norm" in chosen:
            _set_forward(state, module, _norm_forward(router, module), "rms_norm")
        elif role == "layer" and "add_rms_norm" in chosen:
            _set_forward(state, module, _layer_forward(router, module), "add_rms_norm")
        elif role == "attention" and ({"rope", "masked_softmax"} & set(chosen)):
            _set_forward(
                state, module, _attention_forward(router, module, family, modeling), "attention"
            )
        elif role == "mlp" and "swiglu" in chosen:
            act = getattr(getattr(module, "config", None), "hidden_act", None)
            if act in ("silu", "swish"):
                _set_forward(state, module, _mlp_forward(router, module), "swiglu")
            else:
                state.skipped.append(f"{name} ({type(module).__name__}: activation {act})")
        elif role == "moe" and "moe" in chosen:
            _set_forward(state, module, _moe_forward(router, module), "moe")
    if not state.modules:
        kinds = sorted({s.split(" (", 1)[1].rstrip(")") for s in state.skipped})
        warnings.warn(
            f"mxdb.integrations.transformers.patch: {type(model).__name__} is not a model "
            f"family mxdb knows ({', '.join(FAMILIES)}); left untouched. Skipped modules: "
            f"{', '.join(kinds) if kinds else 'none'}",
            stacklevel=2,
        )
    elif state.skipped:
        warnings.warn(
            "mxdb.integrations.transformers.patch: left untouched: " + ", ".join(state.skipped),
            stacklevel=2,
        )
    setattr(model, _ATTR, state)
    return state


def _looks_relevant(module: Any) -> bool:
    """A module of a kind patch would route in a known family (norms, attention, MLPs, MoE)."""
    name = type(module).__name__
    return any(s in name for s in ("RMSNorm", "Attention", "MLP", "DecoderLayer", "MoeBlock"))


def unpatch(model: Any) -> None:
    """Undo ``patch``: every module's forward is the one it had before, exactly."""
    state: PatchState | None = getattr(model, _ATTR, None)
    if state is None:
        return
    for module, previous in reversed(state.modules):
        if previous is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = previous
    delattr(model, _ATTR)


def state_of(model: Any) -> PatchState | None:
    """The patch state of ``model`` (None when not patched)."""
    return getattr(model, _ATTR, None)
