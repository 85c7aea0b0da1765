"""Shapes and kernel configs: validation, hashing, round-trips."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mxdb import GemmConfig, KernelConfig, MoEShape
from mxdb.configs import config_hash
from mxdb.errors import ConfigError, ShapeError
from mxdb.shapes import canonical_dtype, preset_shape


def test_public_constructor_and_fields() -> None:
    s = MoEShape(experts=8, hidden=4096, intermediate=14336, topk=2, tokens=4, dtype="bfloat16")
    assert (s.op, s.dtype, s.experts, s.hidden, s.intermediate, s.topk, s.tokens) == (
        "fused_moe",
        "bf16",
        8,
        4096,
        14336,
        2,
        4,
    )
    assert s.family == "E8-H4096-I14336-k2"
    assert s.with_tokens(16).tokens == 16 and s.with_tokens(16).family == s.family
    assert MoEShape.from_dict(s.to_dict()) == s
    assert pickle.loads(pickle.dumps(s)) == s
    assert "experts=8" in repr(s)


def test_shapes_hash_like_tuples_and_differ_by_dtype() -> None:
    a = MoEShape(8, 4096, 14336, 2, 4, "bf16")
    b = MoEShape(8, 4096, 14336, 2, 4, "torch.bfloat16")
    c = MoEShape(8, 4096, 14336, 2, 4, "fp16")
    assert a == b and hash(a) == hash(b)
    assert a != c
    assert {a: 1}[b] == 1


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"experts": 0}, "experts must be a positive integer"),
        ({"hidden": -1}, "hidden must be a positive integer"),
        ({"tokens": 2.5}, "tokens must be a positive integer"),
        ({"topk": 9}, "topk (9) cannot exceed the number of experts (8)"),
        ({"dtype": "int8"}, "dtype 'int8' is not supported; use one of fp16, bf16, fp32"),
        ({"experts": True}, "experts must be a positive integer"),
    ],
)
def test_impossible_shapes_are_named(kwargs: dict[str, object], needle: str) -> None:
    base: dict[str, object] = dict(
        experts=8, hidden=64, intermediate=128, topk=2, tokens=4, dtype="bf16"
    )
    base.update(kwargs)
    with pytest.raises(ShapeError) as err:
        MoEShape(**base)  # type: ignore[arg-type]
    assert needle in str(err.value)


def test_presets_and_dtype_names() -> None:
    assert preset_shape("Mixtral-8x7B", 4).family == "E8-H4096-I14336-k2"
    assert preset_shape("qwen3-30b-a3b", 1).family == "E128-H2048-I768-k8"
    with pytest.raises(ShapeError, match="known presets"):
        preset_shape("llama", 1)
    assert canonical_dtype("half") == "fp16"


def test_gemm_config_triton_round_trip() -> None:
    g = GemmConfig(block_m=16, block_n=128, block_k=64, group_m=1, num_warps=4, num_stages=2)
    t = g.to_triton()
    assert t == {
        "BLOCK_SIZE_M": 16,
        "BLOCK_SIZE_N": 128,
        "BLOCK_SIZE_K": 64,
        "GROUP_SIZE_M": 1,
        "num_warps": 4,
        "num_stages": 2,
    }
    assert GemmConfig.from_triton(t) == g


def test_kernel_config_alignment_rule() -> None:
    g16 = GemmConfig(block_m=16, block_n=64, block_k=64)
    g32 = GemmConfig(block_m=32, block_n=64, block_k=64)
    ok = KernelConfig(gemm1=g16, gemm2=g32, align_block=64)
    assert ok.align_block == 64
    with pytest.raises(ValueError, match="must be a multiple of gemm2.block_m"):
        KernelConfig(gemm1=g16, gemm2=g32, align_block=16)
    with pytest.raises(ConfigError, match="must be a multiple"):
        KernelConfig.parse(
            {"gemm1": g16.model_dump(), "gemm2": g32.model_dump(), "align_block": 16}
        )


@pytest.mark.parametrize(
    "data, needle",
    [
        ("{not json", "not valid JSON"),
        ([1, 2], "must be an object"),
        ({"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 48, "BLOCK_SIZE_K": 64}, "power of two"),
        ({"BLOCK_SIZE_M": 16, "BLOCK_SIZE_X": 4}, "valid keys are"),
        (
            {"gemm1": {"block_m": 16, "block_n": 64, "block_k": 64}, "extra": 1},
            "unknown kernel config keys",
        ),
        ({"BLOCK_SIZE_M": 0, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64}, "block_m"),
    ],
)
def test_bad_configs_get_clear_errors(data: object, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        KernelConfig.parse(data)
    assert needle in str(err.value)


pow2 = st.sampled_from([16, 32, 64, 128, 256])
gemms = st.builds(
    GemmConfig,
    block_m=pow2,
    block_n=st.sampled_from([32, 64, 128, 256]),
    block_k=st.sampled_from([32, 64, 128, 256]),
    group_m=st.sampled_from([1, 8, 16, 32, 64]),
    num_warps=st.sampled_from([2, 4, 8]),
    num_stages=st.integers(1, 6),
)


@given(g1=gemms, g2=gemms, mult=st.sampled_from([1, 2, 4]))
def test_kernel_config_json_round_trip_and_hash(g1: GemmConfig, g2: GemmConfig, mult: int) -> None:
    config = KernelConfig(gemm1=g1, gemm2=g2, align_block=max(g1.block_m, g2.block_m) * mult)
    again = KernelConfig.parse(config.canonical_json())
    assert again == config
    assert again.hash == config.hash == config_hash(config.model_dump())
    assert len(config.hash) == 16


@given(g=gemms)
def test_flat_vllm_dict_means_same_config_both_gemms(g: GemmConfig) -> None:
    config = KernelConfig.parse(g.to_triton())
    assert config.gemm1 == config.gemm2 == g and config.align_block == g.block_m
    assert config.short() == g.short()
