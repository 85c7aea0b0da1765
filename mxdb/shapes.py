"""Shapes: the hot-path keys of the store and the dispatcher.

A shape is a tuple subclass (``op`` first, then the op's dimensions), so that
hashing and comparing it on the dispatch hot path costs what a tuple costs.
Validation happens once, when the shape is built.
"""

from __future__ import annotations

import re
from typing import Any

from mxdb.errors import ShapeError

#: Canonical dtype names, and the spellings accepted for each.
DTYPES: dict[str, str] = {
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
}

#: Bytes per element of each canonical dtype.
DTYPE_BYTES: dict[str, int] = {"fp16": 2, "bf16": 2, "fp32": 4}

MOE_OP = "fused_moe"

#: Largest value each dimension of a shape may take (checked when a shape is built, so that a
#: hostile size never reaches an allocation or a database column).
MAX_EXPERTS = 65_536
MAX_DIMS: dict[str, int] = {
    "experts": MAX_EXPERTS,
    "hidden": 1 << 20,
    "intermediate": 1 << 20,
    "topk": 1024,
    "tokens": 1 << 24,
}


def canonical_dtype(dtype: object) -> str:
    """Return the canonical name (fp16, bf16, fp32) of ``dtype``, given as a string or torch dtype."""
    name = str(dtype).strip().lower()
    try:
        return DTYPES[name]
    except KeyError:
        raise ShapeError(
            f"dtype {dtype!r} is not supported; use one of fp16, bf16, fp32 "
            f"(also accepted: {', '.join(sorted(k for k in DTYPES if k not in DTYPE_BYTES))})"
        ) from None


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise ShapeError(f"{name} must be a positive integer, got {value!r}")
    if isinstance(value, int):
        as_int = value
    else:
        # numpy integers and the like are fine if they convert exactly
        try:
            as_int = int(value)  # type: ignore[call-overload]
        except (TypeError, ValueError):
            raise ShapeError(f"{name} must be a positive integer, got {value!r}") from None
        if as_int != value:
            raise ShapeError(f"{name} must be a positive integer, got {value!r}")
    if as_int <= 0:
        raise ShapeError(f"{name} must be a positive integer, got {value}")
    limit = MAX_DIMS.get(name)
    if limit is not None and as_int > limit:
        raise ShapeError(f"{name} is {as_int:,}, above the limit of {limit:,}")
    return as_int


class MoEShape(tuple):  # type: ignore[type-arg]
    """One call of the fused-MoE layer: ``(op, dtype, experts, hidden, intermediate, topk, tokens)``.

    ``intermediate`` is the per-expert intermediate size I (w1 is ``[E, 2I, H]``,
    w2 is ``[E, H, I]``); vLLM's table files call it N.
    """

    __slots__ = ()

    FIELDS = ("experts", "hidden", "intermediate", "topk", "tokens")

    def __new__(
        cls,
        experts: int,
        hidden: int,
        intermediate: int,
        topk: int,
        tokens: int,
        dtype: object = "bf16",
    ) -> MoEShape:
        e = _positive_int("experts", experts)
        h = _positive_int("hidden", hidden)
        i = _positive_int("intermediate", intermediate)
        k = _positive_int("topk", topk)
        m = _positive_int("tokens", tokens)
        if k > e:
            raise ShapeError(f"topk ({k}) cannot exceed the number of experts ({e})")
        return tuple.__new__(cls, (MOE_OP, canonical_dtype(dtype), e, h, i, k, m))

    op = property(lambda self: self[0], doc="The op name, always 'fused_moe'.")
    dtype = property(lambda self: self[1], doc="Canonical dtype name.")
    experts = property(lambda self: self[2], doc="Number of experts E.")
    hidden = property(lambda self: self[3], doc="Hidden size H.")
    intermediate = property(lambda self: self[4], doc="Per-expert intermediate size I.")
    topk = property(lambda self: self[5], doc="Experts per token k.")
    tokens = property(lambda self: self[6], doc="Tokens in the batch M.")

    @property
    def family(self) -> str:
        """The shape without its token count: what a table file or a lean layer is built for."""
        return f"E{self[2]}-H{self[3]}-I{self[4]}-k{self[5]}"

    def with_tokens(self, tokens: int) -> MoEShape:
        """The same shape at another token count."""
        return MoEShape(self[2], self[3], self[4], self[5], tokens, self[1])

    def dims(self) -> dict[str, int]:
        """The dimensions as a plain dict (without op and dtype)."""
        return dict(zip(self.FIELDS, self[2:], strict=True))

    def to_dict(self) -> dict[str, Any]:
        return {"op": self[0], "dtype": self[1], **self.dims()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MoEShape:
        """Build from a dict with the fields of ``to_dict`` (``op``, if present, must be fused_moe)."""
        if not isinstance(data, dict):
            raise ShapeError(f"a shape must be an object, got {type(data).__name__}")
        op = data.get("op", MOE_OP)
        if op != MOE_OP:
            raise ShapeError(f"shape op is {op!r}; expected {MOE_OP!r}")
        missing = [f for f in (*cls.FIELDS, "dtype") if f not in data]
        if missing:
            raise ShapeError(
                f"shape is missing {', '.join(missing)}; a shape needs "
                f"{', '.join((*cls.FIELDS, 'dtype'))}"
            )
        return cls(**{f: data[f] for f in (*cls.FIELDS, "dtype")})

    def __repr__(self) -> str:
        return (
            f"MoEShape(experts={self[2]}, hidden={self[3]}, intermediate={self[4]}, "
            f"topk={self[5]}, tokens={self[6]}, dtype={self[1]!r})"
        )

    def __getnewargs__(self) -> tuple[Any, ...]:  # pickling
        return (self[2], self[3], self[4], self[5], self[6], self[1])

    def memory_floor_bytes(self, active_experts: int | None = None) -> int:
        """Bytes of expert weights a call must read: active experts x 3 x H x I x bytes per element."""
        e, h, i, k, m = (int(x) for x in self[2:])
        e_active = active_experts if active_experts is not None else min(e, k * m)
        return memory_floor_bytes(e_active, h, i, str(self[1]))


def memory_floor_bytes(active_experts: int, hidden: int, intermediate: int, dtype: str) -> int:
    """Bytes of expert weights a call must read: active experts x 3 x H x I x bytes per element.

    The memory-bound floor of every report and claim (its time is these bytes / bandwidth); an
    unknown dtype counts 2 bytes per element.
    """
    return active_experts * 3 * hidden * intermediate * DTYPE_BYTES.get(dtype, 2)


#: Model presets: (experts, hidden, intermediate, topk) of the routed-expert MoE layer, unsharded
#: (the values of the models' public Hugging Face configs; ``mxdb.modelconfig`` shards them).
PRESETS: dict[str, tuple[int, int, int, int]] = {
    "mixtral-8x7b": (8, 4096, 14336, 2),
    "mixtral-8x22b": (8, 6144, 16384, 2),
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "qwen3-235b-a22b": (128, 4096, 1536, 8),
    "qwen1.5-moe-a2.7b": (60, 2048, 1408, 4),
    "qwen2-57b-a14b": (64, 3584, 2560, 8),
    "deepseek-v2-lite": (64, 2048, 1408, 6),
    "deepseek-v2": (160, 5120, 1536, 6),
    "deepseek-v3": (256, 7168, 2048, 8),
    "llama-4-scout": (16, 5120, 8192, 1),
    "llama-4-maverick": (128, 5120, 8192, 1),
    "olmoe-1b-7b": (64, 2048, 1024, 8),
    "gpt-oss-20b": (32, 2880, 2880, 4),
    "gpt-oss-120b": (128, 2880, 2880, 4),
}


def preset_shape(name: str, tokens: int, dtype: object = "bf16") -> MoEShape:
    """The MoE shape of a known model at ``tokens`` tokens."""
    try:
        e, h, i, k = PRESETS[name.lower()]
    except KeyError:
        raise ShapeError(
            f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}"
        ) from None
    return MoEShape(e, h, i, k, tokens, dtype)


_FAMILY_KEY = re.compile(r"^E(\d+)-H(\d+)-I(\d+)-k(\d+)$")


def family_shape(name: str, tokens: int, dtype: object = "bf16") -> MoEShape:
    """The MoE shape of a known model preset, or of a family key (``E8-H4096-I3584-k2``, as
    :attr:`MoEShape.family` writes it), at ``tokens`` tokens."""
    match = _FAMILY_KEY.match(name)
    if match is None:
        return preset_shape(name, tokens, dtype)
    e, h, i, k = (int(g) for g in match.groups())
    return MoEShape(e, h, i, k, tokens, dtype)


class OpShape(tuple):  # type: ignore[type-arg]
    """A call of any other op (a decode op such as ``rms_norm``): ``(op, dtype, family, tokens)``.

    ``dims`` are the op's sizes other than the row count ``tokens``; the family
    is their canonical string, so that entries of one shape family share rows in
    the store, like the MoE shapes' families.
    """

    __slots__ = ()

    def __new__(cls, op: str, dims: dict[str, int], tokens: int, dtype: object = "bf16") -> OpShape:
        if not op or not isinstance(op, str):
            raise ShapeError(f"op must be a non-empty name, got {op!r}")
        clean = {str(k): _positive_int(str(k), v) for k, v in sorted(dims.items())}
        family = "-".join(f"{k}{v}" for k, v in clean.items()) or "any"
        m = _positive_int("tokens", tokens)
        return tuple.__new__(cls, (op, canonical_dtype(dtype), family, m))

    op = property(lambda self: self[0], doc="The op name.")
    dtype = property(lambda self: self[1], doc="Canonical dtype name.")
    family = property(lambda self: self[2], doc="The op's sizes without the row count.")
    tokens = property(lambda self: self[3], doc="Rows (tokens) in the call.")

    def __getnewargs__(self) -> tuple[Any, ...]:  # pickling
        dims = {}
        for part in self[2].split("-") if self[2] != "any" else []:
            name = part.rstrip("0123456789")
            dims[name] = int(part[len(name) :])
        return (self[0], dims, self[3], self[1])
