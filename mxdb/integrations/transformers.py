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
  run through mxdb's MoE layer (``mxdb.kernels.layer.MoELayer``) with the dispatched config,
  or FlagGems' own config choice for a token count mxdb has no confident answer for.  When the
  FlagGems hook is installed (``mxdb.install()``), the block calls the hook instead, so the
  routing monitor, self-healing and the lean layer serve the model (counted as ``("moe",
  "hook")``).

Each call asks ``dispatcher.dispatch(OpShape(op, dims, rows, dtype), None)`` (a cached dict
lookup).  The decision's ``config["impl"]`` (``fused``, ``flaggems`` or ``torch``) picks the
implementation from :mod:`mxdb.kernels.impls`; a fallback decision, or an implementation
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
from mxdb.kernels.impls import DECODE_OPS
from mxdb.shapes import OpShape, canonical_dtype

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
    """Per-call choice of implementation.

    Each patched module keeps a table ``{call key: (shape, decision, impl, count key)}``, the
    call key being what the module's input shapes and dtype make cheaply (``(x.shape,
    x.dtype)`` and the like).  A call is one table lookup, one ``dispatcher.dispatch`` of the
    cached :class:`OpShape` (a dict lookup) and the implementation's call.  The decision the
    dispatcher answers is compared by identity with the one the entry was built from: a store
    change, a ``refresh()`` or an override gives a new decision object, and the entry is
    rebuilt, so the dispatcher's refresh semantics hold exactly.
    """

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

    def shape(self, op: str, dims: tuple[tuple[str, int], ...], rows: int, dtype: Any) -> Any:
        key = (op, dims, rows, dtype)
        shape = self._shapes.get(key)
        if shape is None:
            shape = OpShape(op, dict(dims), max(1, rows), self.dtype(dtype))
            self._shapes[key] = shape
        return shape

    def route(
        self,
        table: dict[Any, Entry],
        key: Any,
        op: str,
        dims: tuple[tuple[str, int], ...],
        rows: int,
        dtype: Any,
    ) -> Entry:
        """Build (on a miss or a changed decision) the table entry of one call key."""
        shape = self.shape(op, dims, rows, dtype)
        decision = self.dispatcher.dispatch(shape, None)
        fn = None
        name = "original"
        config = decision.config
        if config is not None:
            chosen = config.get("impl")
            fn = self.impls.get(chosen, {}).get(op)
            if fn is not None:
                name = chosen
        entry = (shape, decision, fn, (op, name))
        table[key] = entry
        return entry

    def impl(self, op: str, dims: tuple[tuple[str, int], ...], rows: int, dtype: Any) -> Any:
        """The implementation to run, or None for the module's original code (counted)."""
        _, _, fn, counted = self.route({}, None, op, dims, rows, dtype)
        self.calls[counted] += 1
        return fn


#: A call key's routing: (OpShape, the decision it came from, impl or None, (op, impl name)).
Entry = tuple[Any, Any, Any, tuple[str, str]]


def _topk(block: Any) -> int:
    return int(getattr(block, "top_k", None) or block.gate.top_k)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _rows(shape: Any) -> int:
    rows = 1
    for s in shape[:-1]:
        rows *= s
    return int(rows)


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


def _version(t: Any) -> int:
    """``t``'s in-place version counter (-1 for inference tensors, which have none)."""
    try:
        return int(t._version)
    except RuntimeError:
        return -1


class Handoff:
    """The MLP residual of one decoder layer fused with the next RMSNorm (``add_rms_norm``).

    The layer returns ``h = residual + mlp_out`` (rounded exactly as the unfused add) and
    leaves ``rms_norm(h)`` here, addressed to the next norm module (the next layer's
    ``input_layernorm``, or the model's final norm).  That norm takes it only when it is
    called on that very tensor, unmodified (same object, same version counter); otherwise
    it computes as usual.  One handoff per model; it holds the tensors of one step at most.
    """

    __slots__ = ("normed", "source", "target", "version")

    def __init__(self) -> None:
        self.source: Any = None
        self.target: Any = None
        self.normed: Any = None
        self.version = -1

    def take(self, x: Any, norm: Any) -> Any:
        """The pending normed tensor if it is ``norm(x)``, else None; clears the handoff."""
        src = self.source
        if src is None:
            return None
        normed = self.normed
        ok = src is x and self.target is norm and _version(x) == self.version
        self.source = self.target = self.normed = None
        return normed if ok else None

    def put(self, source: Any, norm: Any, normed: Any) -> None:
        self.source = source
        self.target = norm
        self.normed = normed
        self.version = _version(source)


# -- per-role forwards --------------------------------------------------------------------------


def _norm_forward(router: Router, norm: Any, handoff: Handoff | None) -> Callable[..., Any]:
    orig = _original(norm)
    params = norm._parameters
    table: dict[Any, Entry] = {}
    get = table.get
    dispatch = router.dispatcher.dispatch
    route = router.route
    calls = router.calls

    def forward(hidden_states: Any) -> Any:
        if handoff is not None and handoff.source is not None:
            done = handoff.take(hidden_states, norm)
            if done is not None:
                return done
        key = (hidden_states.shape, hidden_states.dtype)
        e = get(key)
        if e is None or dispatch(e[0], None) is not e[1]:
            shape = key[0]
            e = route(table, key, "rms_norm", (("n", shape[-1]),), _rows(shape), key[1])
        calls[e[3]] += 1
        fn = e[2]
        if fn is None:
            return orig(hidden_states)
        return fn(hidden_states, params["weight"], norm.variance_epsilon)

    return forward


def _layer_forward(
    router: Router, layer: Any, handoff: Handoff, next_norm: Any
) -> Callable[..., Any]:
    """The decoder layer with its two residual adds fused into the following RMSNorms.

    Attention residual + ``post_attention_layernorm``: one ``add_rms_norm``.  MLP residual +
    ``next_norm`` (the next layer's input norm or the final norm; None: no fusion): one
    ``add_rms_norm`` whose normed half goes through ``handoff``.
    """
    orig = _original(layer)
    mods = layer._modules
    table: dict[Any, Entry] = {}
    get = table.get
    dispatch = router.dispatcher.dispatch
    route = router.route
    calls = router.calls
    take = handoff.take
    put = handoff.put

    def forward(hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        if args:  # positional arguments: a caller we do not know; keep the original code
            return orig(hidden_states, *args, **kwargs)
        if "past_key_values" in kwargs and "cache" not in kwargs:
            kwargs["cache"] = kwargs.pop("past_key_values")
        residual = hidden_states
        inp = mods["input_layernorm"]
        h = take(hidden_states, inp) if handoff.source is not None else None
        if h is None:
            h = inp(hidden_states)
        h, _ = mods["self_attn"](hidden_states=h, **kwargs)
        key = (h.shape, h.dtype)
        e = get(key)
        if e is None or dispatch(e[0], None) is not e[1]:
            shape = key[0]
            e = route(table, key, "add_rms_norm", (("n", shape[-1]),), _rows(shape), key[1])
        calls[e[3]] += 1
        fn = e[2]
        post = mods["post_attention_layernorm"]
        if fn is None:
            h = residual + h
            residual = h
            h = post(h)
        else:
            h, residual = fn(h, residual, post._parameters["weight"], post.variance_epsilon)
        h = mods["mlp"](h)
        if next_norm is None or fn is None or (h.shape, h.dtype) != key:
            return residual + h
        # the attention residual's key (same rows, width and dtype): its decision holds
        normed, out = fn(h, residual, next_norm._parameters["weight"], next_norm.variance_epsilon)
        calls[e[3]] += 1
        put(out, next_norm, normed)
        return out

    return forward


def _attention_forward(
    router: Router, attn: Any, family: Family, modeling: Any
) -> Callable[..., Any]:
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    matmul = torch.matmul
    dropout_fn = torch.nn.functional.dropout
    repeat_kv = modeling.repeat_kv
    stock_eager = modeling.eager_attention_forward
    apply_rope = modeling.apply_rotary_pos_emb
    get_interface = ALL_ATTENTION_FUNCTIONS.get_interface
    mods = attn._modules
    dispatch = router.dispatcher.dispatch
    route = router.route
    calls = router.calls
    rope_on = "rope" in router.ops
    softmax_on = "masked_softmax" in router.ops
    rope_table: dict[Any, Entry] = {}
    rope_get = rope_table.get
    sm_table: dict[Any, Entry] = {}
    sm_get = sm_table.get
    sliding = family.sliding

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
        qshape = query.shape
        kv = key.shape[-2]
        ck = (qshape, (kv - 1).bit_length() if kv > 0 else 0, query.dtype)
        e = sm_get(ck)
        if e is None or dispatch(e[0], None) is not e[1]:
            bsz, heads, sq, _ = qshape
            dims = (("h", heads), ("k", _pow2(kv)))
            e = route(sm_table, ck, "masked_softmax", dims, bsz * sq, ck[2])
        calls[e[3]] += 1
        fn = e[2]
        if fn is None:
            return stock_eager(
                module,
                query,
                key,
                value,
                attention_mask,
                scaling=scaling,
                dropout=dropout,
                **kwargs,
            )
        groups = module.num_key_value_groups
        key_states = repeat_kv(key, groups)
        value_states = repeat_kv(value, groups)
        scores = matmul(query, key_states.transpose(2, 3))
        probs = fn(scores, attention_mask, scaling)
        if dropout:
            probs = dropout_fn(probs, p=dropout, training=module.training)
        out = matmul(probs, value_states).transpose(1, 2).contiguous()
        return out, probs

    def forward(
        hidden_states: Any,
        position_embeddings: Any = None,
        attention_mask: Any = None,
        cache: Any = None,
        **kwargs: Any,
    ) -> Any:
        if cache is None and "past_key_values" in kwargs:
            cache = kwargs.pop("past_key_values")
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, attn.head_dim)
        q = mods["q_proj"](hidden_states).view(hidden_shape)
        k = mods["k_proj"](hidden_states).view(hidden_shape)
        q_norm = mods.get("q_norm")
        if q_norm is not None:
            q = q_norm(q)
            k = mods["k_norm"](k)
        q = q.transpose(1, 2)
        k = k.transpose(1, 2)
        v = mods["v_proj"](hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        fn = None
        if rope_on:
            # q is [B, Hq, S, D], k [B, Hk, S, D]: both follow from the input shape and the
            # module's projections, so (input shape, dtype) keys the decision
            ck = (input_shape, q.dtype)
            e = rope_get(ck)
            if e is None or dispatch(e[0], None) is not e[1]:
                qs = q.shape
                dims = (("d", qs[3]), ("hk", k.shape[1]), ("hq", qs[1]))
                e = route(rope_table, ck, "rope", dims, qs[0] * qs[2], ck[1])
            calls[e[3]] += 1
            fn = e[2]
        if fn is None:
            q, k = apply_rope(q, k, cos, sin)
        else:
            q, k = fn(q, k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, attn.layer_idx, kwargs=kwargs)
        impl = attn.config._attn_implementation
        if softmax_on and impl == "eager":
            interface: Callable[..., Any] = eager
        else:
            interface = get_interface(impl, stock_eager)
        drop = attn.attention_dropout if attn.training else 0.0
        if sliding == "attr":
            kwargs["sliding_window"] = attn.sliding_window
        elif sliding == "config":
            kwargs["sliding_window"] = getattr(attn.config, "sliding_window", None)
        out, weights = interface(
            attn, q, k, v, attention_mask, dropout=drop, scaling=attn.scaling, **kwargs
        )
        out = out.reshape(*input_shape, -1).contiguous()
        return mods["o_proj"](out), weights

    return forward


def _mlp_forward(router: Router, mlp: Any) -> Callable[..., Any]:
    orig = _original(mlp)
    mods = mlp._modules
    table: dict[Any, Entry] = {}
    get = table.get
    dispatch = router.dispatcher.dispatch
    route = router.route
    calls = router.calls

    def forward(x: Any) -> Any:
        key = (x.shape, x.dtype)
        e = get(key)
        if e is None or dispatch(e[0], None) is not e[1]:
            n = mods["gate_proj"].out_features
            e = route(table, key, "swiglu", (("n", n),), _rows(key[0]), key[1])
        calls[e[3]] += 1
        fn = e[2]
        if fn is None:
            return orig(x)
        return mods["down_proj"](fn(mods["gate_proj"](x), mods["up_proj"](x)))

    return forward


def _moe_usable() -> bool:
    from mxdb.kernels.impls import flaggems_usable, fused_usable

    return bool(fused_usable() and flaggems_usable())


def _moe_forward(router: Router, block: Any) -> Callable[..., Any]:
    orig = _original(block)
    layers: dict[Any, Any] = {}

    def forward(hidden_states: Any) -> Any:
        bsz, seq, hidden = hidden_states.shape
        # Without a confident answer the layer still runs, with FlagGems' own config choice (as
        # the FlagGems hook does); only a process that cannot run the kernels keeps the original.
        if not hidden_states.is_cuda or not _moe_usable():
            router.calls[("moe", "original")] += 1
            return orig(hidden_states)
        import torch

        from mxdb.runtime.hook import installed

        x = hidden_states.reshape(-1, hidden)
        _, weights, ids = block.gate(x)
        hook = installed()
        if hook is not None:
            # The FlagGems hook is installed: the call goes through it, so the routing monitor,
            # healing and the lean layer serve the model's MoE blocks like any FlagGems caller.
            experts = block.experts
            out = hook.call(
                (
                    x.contiguous(),
                    experts.gate_up_proj,
                    experts.down_proj,
                    weights.to(torch.float32),
                    ids.to(torch.int32).contiguous(),
                ),
                {},
            )
            router.calls[("moe", "hook")] += 1
            return out.view(bsz, seq, hidden)
        key = hidden_states.dtype
        layer = layers.get(key)
        if layer is None:
            from mxdb.dispatcher import dispatch_config_for
            from mxdb.kernels.layer import MoELayer

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
    implementations usable here (:func:`mxdb.kernels.impls.available`).  Returns the
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
        from mxdb.kernels.impls import available

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
    chains = _chains(model, roles, chosen)
    for name, module in model.named_modules():
        hit = roles.get(type(module))
        if hit is None:
            if name and _looks_relevant(module):
                state.skipped.append(f"{name} ({type(module).__name__})")
            continue
        role, family, modeling = hit
        if role == "norm" and "rms_norm" in chosen:
            handoff = chains.tails.get(id(module))
            _set_forward(state, module, _norm_forward(router, module, handoff), "rms_norm")
        elif role == "layer" and "add_rms_norm" in chosen:
            handoff, nxt = chains.layers.get(id(module), (Handoff(), None))
            fwd = _layer_forward(router, module, handoff, nxt)
            _set_forward(state, module, fwd, "add_rms_norm")
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
    known = any(type(m) in roles for m in model.modules())
    if not state.modules and known:
        warnings.warn(
            f"mxdb.integrations.transformers.patch: {type(model).__name__} has no module for "
            f"the ops asked for ({', '.join(chosen)}); nothing was patched",
            stacklevel=2,
        )
    elif not state.modules:
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


@dataclass
class _Chains:
    """Where a decoder layer's MLP residual is fused with the next RMSNorm."""

    #: id(layer) -> (its model's handoff, the next norm module or None)
    layers: dict[int, tuple[Handoff, Any]] = field(default_factory=dict)
    #: id(final norm) -> the handoff it takes from the last layer
    tails: dict[int, Handoff] = field(default_factory=dict)


def _chains(
    model: Any, roles: dict[type, tuple[str, Family, Any]], chosen: tuple[str, ...]
) -> _Chains:
    """Find each stack of decoder layers (``layers`` + final ``norm`` of a known family).

    Layer i hands its MLP residual's normed half to layer i+1's ``input_layernorm`` (which
    the patched layer forward calls), and the last layer to the final ``norm`` when that norm
    is patched here (``rms_norm`` routed); every pair must sit on one device.
    """
    out = _Chains()
    if "add_rms_norm" not in chosen:
        return out
    for module in model.modules():
        layers = module._modules.get("layers")
        final = module._modules.get("norm")
        if layers is None or not isinstance(layers, Iterable):
            continue
        stack = list(layers)
        if not stack or any(roles.get(type(m), ("",))[0] != "layer" for m in stack):
            continue
        handoff = Handoff()
        tail_ok = (
            final is not None
            and "rms_norm" in chosen
            and roles.get(type(final), ("",))[0] == "norm"
        )
        for i, layer in enumerate(stack):
            nxt = (
                stack[i + 1].input_layernorm if i + 1 < len(stack) else (final if tail_ok else None)
            )
            if nxt is not None and not _same_device(layer.post_attention_layernorm, nxt):
                nxt = None
            out.layers[id(layer)] = (handoff, nxt)
        if tail_ok and out.layers[id(stack[-1])][1] is final:
            out.tails[id(final)] = handoff
    return out


def _same_device(a: Any, b: Any) -> bool:
    wa = a._parameters.get("weight")
    wb = b._parameters.get("weight")
    return wa is not None and wb is not None and wa.device == wb.device


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
