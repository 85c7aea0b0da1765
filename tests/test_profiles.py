"""Device profiles: the built-in table, name lookup, and the live path without a GPU."""

from __future__ import annotations

import pytest

from mxdb.errors import GpuUnavailableError, UsageError
from mxdb.profiles import (
    PROFILES,
    DeviceProfile,
    get_profile,
    profile_for_device_name,
    profile_from_mapping,
    profile_names,
    resolve_profile,
)


def test_c500_facts_from_design() -> None:
    c500 = get_profile("c500")
    assert (c500.smem_per_block, c500.warp_size, c500.vendor) == (65536, 64, "metax")
    assert c500.smem_buffer_rule == "mctriton"  # calibrated on the recorded C500 failure
    assert "73,728" in c500.notes and "assumed" in c500.notes


def test_h200_facts() -> None:
    h200 = get_profile("H200")
    assert (h200.sm_count, h200.smem_per_block, h200.warp_size, h200.arch) == (
        132,
        232448,
        32,
        "sm_90",
    )
    assert h200.wgmma and h200.regs_per_thread == 255 and h200.regs_per_sm == 65536


@pytest.mark.parametrize(
    ("device_name", "profile"),
    [
        ("NVIDIA H200", "h200"),
        ("NVIDIA_H200", "h200"),
        ("NVIDIA H200 NVL", "h200"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA_H100_80GB_HBM3", "h100"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("MetaX C500", "c500"),
        ("MetaX_C500", "c500"),
    ],
)
def test_device_names_map_to_profiles(device_name: str, profile: str) -> None:
    found = profile_for_device_name(device_name)
    assert found is not None and found.name == profile
    assert get_profile(device_name).name == profile


def test_unknown_names() -> None:
    assert profile_for_device_name("AMD Instinct MI300X") is None
    assert profile_for_device_name("") is None
    with pytest.raises(UsageError) as err:
        get_profile("mi300")
    for name in profile_names():
        assert name in str(err.value)


def test_table_is_consistent() -> None:
    for name, p in PROFILES.items():
        assert p.name == name
        assert profile_for_device_name(p.device_name) == p
        assert p.smem_per_block <= (p.smem_per_sm or p.smem_per_block)


def test_profile_from_mapping() -> None:
    facts = get_profile("h200").model_dump()
    assert profile_from_mapping(facts) == get_profile("h200")
    with pytest.raises(UsageError, match="warp_size"):
        profile_from_mapping({**facts, "warp_size": 0})
    assert isinstance(get_profile("a100"), DeviceProfile)


def test_live_without_gpu_layer_is_a_clear_error() -> None:
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is present")
    except ImportError:
        pass
    with pytest.raises(GpuUnavailableError, match="built-in profile"):
        resolve_profile("live")
    assert resolve_profile("c500") == get_profile("c500")
