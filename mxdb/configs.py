"""Kernel configurations: one Triton tile config per GEMM, plus the alignment block.

A fused-MoE layer runs two grouped GEMMs; mxdb lets each take its own tile
config.  ``moe_align_block_size`` pads every expert's token slots to a multiple
of ``align_block``, which must be a multiple of each GEMM's ``BLOCK_SIZE_M`` so
that no GEMM tile straddles two experts.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from mxdb.errors import ConfigError
from mxdb.hashing import canonical_hash

#: Triton's spelling of each GemmConfig field, as vLLM and FlagGems tables write it.
TRITON_KEYS = {
    "block_m": "BLOCK_SIZE_M",
    "block_n": "BLOCK_SIZE_N",
    "block_k": "BLOCK_SIZE_K",
    "group_m": "GROUP_SIZE_M",
    "num_warps": "num_warps",
    "num_stages": "num_stages",
}
_FROM_TRITON = {v: k for k, v in TRITON_KEYS.items()}

#: Launch keys beyond the tile config that vLLM's tables carry for some backends (ROCm:
#: ``waves_per_eu``, ``matrix_instr_nonkdim``, ``kpack``; ``num_ctas``; Intel XPU:
#: ``grf_mode``).  mxdb keeps them with the config they came with and writes them back; its
#: own kernels never launch with them.
EXTRA_LAUNCH_KEYS: tuple[str, ...] = (
    "waves_per_eu",
    "matrix_instr_nonkdim",
    "kpack",
    "num_ctas",
    "grf_mode",
)
LaunchExtra = tuple[tuple[str, int | str], ...]

#: The fused-MoE layer implementations a config may name (``KernelConfig.impl``):
#: ``flaggems``: FlagGems' staged alignment, ``fused_moe_kernel`` for both GEMMs, its SiLU-and-mul
#: and sum kernels (what FlagGems and vLLM run); ``fused_act``: mxdb's one-pass alignment and a
#: GEMM1 that applies SiLU-and-mul in its epilogue (``mxdb.kernels.fused_act``), then FlagGems'
#: GEMM2 and sum; ``fused_slice``: both GEMMs, the activation and the top-k sum in one kernel
#: per (tile of slots, slice of the intermediate dimension) with atomic adds into a float32
#: output (``mxdb.kernels.fused_slice``; small batches).  The first is the default, and the only
#: one peers' tables can express.
IMPLS: tuple[str, ...] = ("flaggems", "fused_act", "fused_slice")
#: The largest batch (tokens x top-k) the tuner times ``fused_slice`` at: its atomic adds grow
#: with the batch, and beyond decode sizes GEMM tiles over many slots read weights better.
FUSED_SLICE_MAX_SLOTS = 512
DEFAULT_IMPL = "flaggems"


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class GemmConfig(BaseModel):
    """The Triton launch config of one grouped GEMM."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    block_m: int = Field(ge=1, le=1024)
    block_n: int = Field(ge=1, le=1024)
    block_k: int = Field(ge=1, le=1024)
    group_m: int = Field(default=1, ge=1, le=256)
    num_warps: int = Field(default=4, ge=1, le=32)
    num_stages: int = Field(default=2, ge=1, le=16)
    #: extra launch keys (``EXTRA_LAUNCH_KEYS``) in the order read; absent (None) for
    #: every config mxdb measures, so its dump and hash are those of the six fields alone
    extra: SkipJsonSchema[LaunchExtra | None] = Field(default=None, repr=False)

    @field_validator("extra", mode="before")
    @classmethod
    def _extra_pairs(cls, value: Any) -> Any:
        if isinstance(value, dict):
            value = tuple(value.items())
        if value is None or len(value) == 0:
            return None
        pairs = tuple((str(k), v) for k, v in value)
        unknown = sorted({k for k, _ in pairs} - set(EXTRA_LAUNCH_KEYS))
        if unknown:
            raise ValueError(
                f"unknown launch keys {unknown}; known: {', '.join(EXTRA_LAUNCH_KEYS)}"
            )
        for k, v in pairs:
            if isinstance(v, bool) or not isinstance(v, (int, str)):
                raise ValueError(f"launch key {k} must be an integer or a string, got {v!r}")
        return pairs

    @model_serializer(mode="wrap")
    def _drop_absent_extra(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if self.extra is None:
            data.pop("extra", None)
        else:
            data["extra"] = dict(self.extra)
        return data

    @model_validator(mode="after")
    def _powers_of_two(self) -> GemmConfig:
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if not _is_pow2(value):
                raise ValueError(f"{name} must be a power of two, got {value}")
        return self

    def to_triton(self) -> dict[str, int]:
        """The dict that ``invoke_fused_moe_triton_kernel`` and vLLM's tables use.

        Extra launch keys (an imported table's) follow the six tile keys, as vLLM writes them.
        """
        out: dict[str, Any] = {TRITON_KEYS[k]: getattr(self, k) for k in TRITON_KEYS}
        for k, v in self.extra or ():
            out[k] = v
        return out

    def without_extra(self) -> GemmConfig:
        """The six-field tile config, without any extra launch keys."""
        return self if self.extra is None else self.model_copy(update={"extra": None})

    @classmethod
    def from_triton(cls, data: dict[str, Any]) -> GemmConfig:
        """Parse a vLLM/FlagGems-style dict (``BLOCK_SIZE_M`` ... ``num_stages``)."""
        if not isinstance(data, dict):
            raise ConfigError(f"a GEMM config must be an object, got {type(data).__name__}")
        unknown = sorted(
            set(data) - set(_FROM_TRITON) - set(TRITON_KEYS) - set(EXTRA_LAUNCH_KEYS) - {"extra"}
        )
        if unknown:
            raise ConfigError(
                f"unknown GEMM config keys {unknown}; valid keys are "
                f"{', '.join(TRITON_KEYS.values())} (and launch keys "
                f"{', '.join(EXTRA_LAUNCH_KEYS)})"
            )
        fields: dict[str, Any] = {
            _FROM_TRITON.get(k, k): v for k, v in data.items() if k not in EXTRA_LAUNCH_KEYS
        }
        extra = tuple((k, v) for k, v in data.items() if k in EXTRA_LAUNCH_KEYS)
        if extra and "extra" in data:
            raise ConfigError("give extra launch keys either flat or under 'extra', not both")
        if extra:
            fields["extra"] = extra
        try:
            return cls(**fields)
        except ValidationError as exc:
            raise ConfigError(f"invalid GEMM config {data}: {_first_error(exc)}") from None

    def short(self) -> str:
        return (
            f"M{self.block_m}/N{self.block_n}/K{self.block_k}/G{self.group_m}"
            f"/w{self.num_warps}/s{self.num_stages}"
            + "".join(f"/{k}={v}" for k, v in self.extra or ())
        )


class KernelConfig(BaseModel):
    """A whole fused-MoE layer config: the implementation, both GEMMs and the alignment block."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gemm1: GemmConfig
    gemm2: GemmConfig
    align_block: int = Field(ge=1, le=1024)
    #: the layer implementation (:data:`IMPLS`); left out of the dump (and so of the hash) when
    #: it is the default, so configs stored before implementations existed keep their identity
    impl: str = Field(default=DEFAULT_IMPL, description="layer implementation: " + ", ".join(IMPLS))

    @field_validator("impl")
    @classmethod
    def _known_impl(cls, value: str) -> str:
        if value not in IMPLS:
            raise ValueError(f"unknown implementation {value!r}; known: {', '.join(IMPLS)}")
        return value

    @model_serializer(mode="wrap")
    def _drop_default_impl(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if self.impl == DEFAULT_IMPL:
            data.pop("impl", None)
        return data

    @model_validator(mode="after")
    def _alignment(self) -> KernelConfig:
        for name in ("gemm1", "gemm2"):
            bm = getattr(self, name).block_m
            if self.align_block % bm:
                raise ValueError(
                    f"align_block ({self.align_block}) must be a multiple of {name}.block_m ({bm})"
                )
        if self.impl == "fused_slice":
            # one kernel: gemm2 holds only block_h (its block_n); the rest follows gemm1, so
            # that two configs that launch the same kernel have one identity
            g1, g2 = self.gemm1, self.gemm2
            want = _slice_gemm2(g1, g2.block_n)
            if g1.group_m != 1 or g2 != want:
                raise ValueError(
                    "a fused_slice config is gemm1 (block_m, block_n = the slice of the "
                    "intermediate dimension, block_k, warps, stages; group_m 1) and gemm2's "
                    f"block_n (block_h); gemm2 must be {want.short()}, got {g2.short()}, "
                    f"and gemm1.group_m 1, got {g1.group_m}"
                )
        return self

    @property
    def single(self) -> bool:
        """One config of FlagGems' kernels for both GEMMs, aligned to its BLOCK_SIZE_M: what
        FlagGems' calls and vLLM's and FlagGems' tables can express."""
        g1 = self.gemm1
        return self.impl == DEFAULT_IMPL and g1 == self.gemm2 and self.align_block == g1.block_m

    def with_impl(self, impl: str) -> KernelConfig:
        """The same tiles under another implementation (``fused_slice``: GEMM1's tiles as the
        slice and hidden step, GEMM2's ``block_n`` as the output chunk, GEMM1's group 1)."""
        if impl == self.impl:
            return self
        if impl == "fused_slice":
            g1 = self.gemm1
            return KernelConfig.fused_slice(
                block_m=g1.block_m, block_i=g1.block_n, block_k=g1.block_k,
                block_h=self.gemm2.block_n, num_warps=g1.num_warps, num_stages=g1.num_stages,
                align_block=self.align_block,
            )  # fmt: skip
        return KernelConfig(
            gemm1=self.gemm1, gemm2=self.gemm2, align_block=self.align_block, impl=impl
        )

    @classmethod
    def fused_slice(
        cls,
        *,
        block_m: int,
        block_i: int,
        block_k: int,
        block_h: int,
        num_warps: int = 4,
        num_stages: int = 3,
        align_block: int | None = None,
    ) -> KernelConfig:
        """The ``fused_slice`` config with these tiles (see ``mxdb.kernels.fused_slice``)."""
        g1 = GemmConfig(
            block_m=block_m, block_n=block_i, block_k=block_k, group_m=1,
            num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
        return cls(
            gemm1=g1,
            gemm2=_slice_gemm2(g1, block_h),
            align_block=align_block or block_m,
            impl="fused_slice",
        )

    @classmethod
    def uniform(cls, gemm: GemmConfig) -> KernelConfig:
        """One config for both GEMMs, aligned to its BLOCK_SIZE_M (what vLLM and FlagGems do)."""
        return cls(gemm1=gemm, gemm2=gemm, align_block=gemm.block_m)

    @classmethod
    def parse(cls, data: Any) -> KernelConfig:
        """Accept mxdb's form ({gemm1, gemm2, align_block}) or a flat vLLM-style dict, or JSON text."""
        if isinstance(data, (str, bytes)):
            from mxdb.fileio import parse_json

            data = parse_json(data, what="config", error=ConfigError)
        if isinstance(data, KernelConfig):
            return data
        if not isinstance(data, dict):
            raise ConfigError(f"a kernel config must be an object, got {type(data).__name__}")
        if "gemm1" in data or "gemm2" in data:
            try:
                g1 = data["gemm1"]
                g2 = data.get("gemm2", g1)
                gemm1 = g1 if isinstance(g1, GemmConfig) else _gemm_any(g1)
                gemm2 = g2 if isinstance(g2, GemmConfig) else _gemm_any(g2)
                align = data.get("align_block", max(gemm1.block_m, gemm2.block_m))
                extra = sorted(set(data) - {"gemm1", "gemm2", "align_block", "impl"})
                if extra:
                    raise ConfigError(
                        f"unknown kernel config keys {extra}; valid: gemm1, gemm2, "
                        "align_block, impl"
                    )
                impl = data.get("impl", DEFAULT_IMPL)
                return cls(gemm1=gemm1, gemm2=gemm2, align_block=align, impl=impl)
            except KeyError:
                raise ConfigError("a kernel config with gemm2 needs gemm1 too") from None
            except ValidationError as exc:
                raise ConfigError(f"invalid kernel config: {_first_error(exc)}") from None
        return cls.uniform(_gemm_any(data))

    def canonical_json(self) -> str:
        return json.dumps(self.model_dump(), sort_keys=True, separators=(",", ":"))

    @property
    def hash(self) -> str:
        """SHA-256 (hex, first 16 digits) of the canonical JSON: the config's identity."""
        return config_hash(self.model_dump())

    def short(self) -> str:
        impl = "" if self.impl == DEFAULT_IMPL else f" | {self.impl}"
        if self.gemm1 == self.gemm2 and self.align_block == self.gemm1.block_m:
            return self.gemm1.short() + impl
        return f"{self.gemm1.short()} | {self.gemm2.short()} | align{self.align_block}{impl}"


def _slice_gemm2(g1: GemmConfig, block_h: int) -> GemmConfig:
    """A ``fused_slice`` config's gemm2: ``block_h`` wide, over ``g1``'s slice, with its launch."""
    return g1.model_copy(update={"block_n": block_h, "block_k": g1.block_n, "extra": None})


def config_hash(config: dict[str, Any]) -> str:
    """The identity of any op's config dict: SHA-256 of its canonical JSON, 16 hex digits."""
    return canonical_hash(config)


def _gemm_any(data: Any) -> GemmConfig:
    if isinstance(data, GemmConfig):
        return data
    if isinstance(data, dict) and any(k in data for k in _FROM_TRITON):
        return GemmConfig.from_triton(data)
    if isinstance(data, dict):
        unknown = sorted(set(data) - set(TRITON_KEYS) - {"extra"})
        if unknown:
            raise ConfigError(
                f"unknown GEMM config keys {unknown}; valid keys are "
                f"{', '.join(TRITON_KEYS)} or {', '.join(TRITON_KEYS.values())}"
            )
        try:
            return GemmConfig(**data)
        except ValidationError as exc:
            raise ConfigError(f"invalid GEMM config {data}: {_first_error(exc)}") from None
    raise ConfigError(f"a GEMM config must be an object, got {type(data).__name__}")


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err.get("loc", ()))
    msg = str(err.get("msg", "invalid"))
    return f"{loc}: {msg}" if loc else msg
