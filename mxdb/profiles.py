"""Device profiles: the hardware limits the resource proxy checks a kernel config against.

A profile comes from the live device (``--profile live``, through the GPU
layer) or from the built-in table below.  Where a number in the table is not
a documented fact it says so in ``notes``; a live profile always wins.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mxdb.errors import GpuUnavailableError, UsageError

#: How many shared-memory buffers Triton's software pipeliner allocates per
#: pipelined load.  "nvidia": Triton 3.x on NVIDIA (``num_stages - 1``, one more
#: when the dot lowers to Hopper wgmma; see ``mxdb.resources``), measured on the H200
#: compile survey.  "mctriton": mcTriton on the MetaX C500, ``max(1, num_stages - 1)``,
#: calibrated on the one recorded C500 compile failure (see ``mxdb.resources``).
#: "num_stages": one buffer per stage, the upper bound for compilers never measured.
SmemBufferRule = Literal["nvidia", "mctriton", "num_stages"]


class DeviceProfile(BaseModel):
    """The limits of one GPU model that decide whether a Triton config can launch."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="short profile name, e.g. h200")
    device_name: str = Field(description="the name the driver reports, e.g. 'NVIDIA H200'")
    vendor: Literal["nvidia", "metax", "other"]
    arch: str | None = Field(default=None, description="e.g. sm_90")
    sm_count: int | None = Field(default=None, ge=1)
    smem_per_block: int = Field(ge=1, description="max (opt-in) dynamic shared memory per block, B")
    smem_per_sm: int | None = Field(default=None, ge=1)
    warp_size: int = Field(ge=1)
    max_threads_per_block: int = Field(default=1024, ge=1)
    regs_per_thread: int = Field(default=255, ge=1, description="max registers per thread")
    regs_per_sm: int = Field(default=65536, ge=1)
    wgmma: bool = Field(default=False, description="Hopper warp-group MMA (sm_90)")
    smem_buffer_rule: SmemBufferRule = "nvidia"
    notes: str = ""


_H100_NOTES = "NVIDIA published limits for compute capability 9.0"

#: The built-in table.  Keys are the profile names accepted by ``get_profile``.
PROFILES: dict[str, DeviceProfile] = {
    "c500": DeviceProfile(
        name="c500",
        device_name="MetaX C500",
        vendor="metax",
        arch="maca",
        sm_count=104,
        smem_per_block=65536,
        warp_size=64,
        max_threads_per_block=1024,
        regs_per_thread=255,
        regs_per_sm=65536,
        smem_buffer_rule="mctriton",
        notes=(
            "smem_per_block (65,536 B) and warp_size (64) are measured facts of the C500 M0 "
            "milestone; the shared-memory rule (num_stages - 1 buffers of the A and B tiles) "
            "is calibrated on that milestone's one recorded compile failure (FlagGems' default "
            "M16/N128/K128/G1/w4/s3, fp16: mcTriton asked for 73,728 B); sm_count, arch, "
            "thread and register limits are assumed values"
        ),
    ),
    "h200": DeviceProfile(
        name="h200",
        device_name="NVIDIA H200",
        vendor="nvidia",
        arch="sm_90",
        sm_count=132,
        smem_per_block=232448,
        smem_per_sm=233472,
        warp_size=32,
        max_threads_per_block=1024,
        regs_per_thread=255,
        regs_per_sm=65536,
        wgmma=True,
        notes="read from torch.cuda.get_device_properties on an H200 (torch 2.11.0+cu130)",
    ),
    "h100": DeviceProfile(
        name="h100",
        device_name="NVIDIA H100 80GB HBM3",
        vendor="nvidia",
        arch="sm_90",
        sm_count=132,
        smem_per_block=232448,
        smem_per_sm=233472,
        warp_size=32,
        wgmma=True,
        notes=_H100_NOTES + " (H100 SXM5: 132 SMs)",
    ),
    "a100": DeviceProfile(
        name="a100",
        device_name="NVIDIA A100-SXM4-80GB",
        vendor="nvidia",
        arch="sm_80",
        sm_count=108,
        smem_per_block=166912,
        smem_per_sm=167936,
        warp_size=32,
        notes="NVIDIA published limits for compute capability 8.0 (A100 SXM4: 108 SMs)",
    ),
}

#: Profile names that need the GPU layer rather than the table.
LIVE = "live"


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "", name.lower())


def profile_names() -> list[str]:
    """The names ``get_profile`` accepts (``live`` needs a GPU)."""
    return [*PROFILES, LIVE]


def profile_for_device_name(device_name: str) -> DeviceProfile | None:
    """The built-in profile of a device name as a driver or a table file spells it.

    Accepts e.g. ``"NVIDIA H200"``, ``"NVIDIA_H200"``, ``"NVIDIA H200 NVL"``,
    ``"NVIDIA H100 80GB HBM3"``, ``"NVIDIA A100-SXM4-80GB"``, ``"MetaX C500"``.
    Returns ``None`` for a device the table does not know.
    """
    key = _norm(device_name)
    if not key:
        return None
    # Most specific first: "h200" must not fall through to "h100" or the like.
    for token, profile in (("h200", "h200"), ("h100", "h100"), ("a100", "a100"), ("c500", "c500")):
        if token in key:
            return PROFILES[profile]
    return None


def get_profile(name: str) -> DeviceProfile:
    """A built-in profile by its name (``c500``, ``h200``, ...) or by a device name."""
    profile = PROFILES.get(name.strip().lower()) or profile_for_device_name(name)
    if profile is None:
        raise UsageError(
            f"unknown device profile {name!r}; known profiles: {', '.join(profile_names())} "
            "(device names such as 'NVIDIA H200' or 'MetaX C500' are accepted too)"
        )
    return profile


def profile_from_mapping(data: Mapping[str, Any]) -> DeviceProfile:
    """Build a profile from device facts (as the GPU layer reports them)."""
    try:
        return DeviceProfile(**dict(data))
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err.get("loc", ()))
        raise UsageError(f"invalid device profile {dict(data)}: {loc}: {err.get('msg')}") from None


def resolve_profile(name: str) -> DeviceProfile:
    """``get_profile``, plus ``live``: the profile of this machine's GPU, from the GPU layer.

    ``live`` imports ``mxdb.kernels`` (and so torch) lazily, only when asked.
    """
    if name.strip().lower() != LIVE:
        return get_profile(name)
    try:
        kernels = importlib.import_module("mxdb.kernels")
        live_profile = kernels.live_profile
    except Exception as exc:  # ImportError, no live_profile yet, or a broken GPU stack
        raise GpuUnavailableError(
            "--profile live needs the GPU layer (mxdb.kernels with torch and a GPU): "
            f"{type(exc).__name__}: {exc}; use a built-in profile instead: {', '.join(PROFILES)}"
        ) from None
    try:
        result = live_profile()
    except GpuUnavailableError:
        raise
    except Exception as exc:  # the GPU stack fails in many ways; name it and move on
        raise GpuUnavailableError(
            f"could not read the live device profile: {type(exc).__name__}: {exc}; "
            f"use a built-in profile instead: {', '.join(PROFILES)}"
        ) from None
    if isinstance(result, DeviceProfile):
        return result
    if isinstance(result, Mapping):
        return profile_from_mapping(result)
    raise GpuUnavailableError(
        f"mxdb.kernels.live_profile() returned {type(result).__name__}, not a device profile"
    )
