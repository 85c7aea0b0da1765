"""The live environment: fingerprint components and the device's resource profile.

Collected once per process from torch, triton, flag_gems and the driver; every component that
cannot be read is ``None`` (a fingerprint records absence rather than guessing).
"""

from __future__ import annotations

import functools
import subprocess
from typing import Any

#: FlagGems sources whose kernels the tuned configs drive: their hash is the kernel source hash.
KERNEL_MODULES = (
    "flag_gems.fused.fused_moe",
    "flag_gems.fused.moe_align_block_size",
    "flag_gems.fused.moe_sum",
)


def kernel_source_hash() -> str | None:
    """The FlagGems fused-MoE kernel source hash: the core's definition, so both sides agree."""
    from mxdb.fingerprint import kernel_source_hash as core_hash

    return core_hash()


def moe_table_hash() -> str | None:
    """The hash of the config table FlagGems reads (data, recorded beside the kernel hash)."""
    from mxdb.fingerprint import moe_table_hash as core_table_hash

    return core_table_hash()


def _driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else str(v)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        pass
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
        line = out.stdout.strip().splitlines()
        if line:
            return line[0].strip()
    except Exception:
        pass
    try:
        from cuda.bindings import driver as cu

        err, v = cu.cuDriverGetVersion()
        if int(err) == 0:
            return f"cuda-driver-api {v // 1000}.{(v % 1000) // 10}"
    except Exception:
        pass
    return None


def _device_props(device_index: int) -> dict[str, Any]:
    import torch

    p = torch.cuda.get_device_properties(device_index)
    props: dict[str, Any] = {
        "name": p.name,
        "major": p.major,
        "minor": p.minor,
        "sm_count": p.multi_processor_count,
        "warp_size": getattr(p, "warp_size", None),
        "smem_per_block": getattr(p, "shared_memory_per_block_optin", None),
        "smem_per_sm": getattr(p, "shared_memory_per_multiprocessor", None),
        "regs_per_sm": getattr(p, "regs_per_multiprocessor", None),
        "max_threads_per_sm": getattr(p, "max_threads_per_multi_processor", None),
        "l2_bytes": getattr(p, "L2_cache_size", None),
        "total_memory": getattr(p, "total_memory", None),
    }
    try:
        from triton.runtime import driver

        tp = driver.active.utils.get_device_properties(device_index)
        props["smem_per_block"] = props["smem_per_block"] or tp.get("max_shared_mem")
        props["warp_size"] = props["warp_size"] or tp.get("warpSize")
        props["regs_per_block"] = tp.get("max_num_regs")
    except Exception:
        props.setdefault("regs_per_block", None)
    return props


def _vendor_and_toolkit() -> tuple[str, str | None]:
    import torch

    maca = getattr(torch.version, "maca", None)
    if maca:
        return "metax", f"maca-{maca}"
    if getattr(torch.version, "hip", None):
        return "amd", f"hip-{torch.version.hip}"
    return "nvidia", f"cuda-{torch.version.cuda}" if torch.version.cuda else None


@functools.lru_cache(maxsize=8)
def live_fingerprint_components(device_index: int = 0) -> dict[str, Any]:
    """The environment components of DESIGN section 6 (all but ``mxdb``), read live."""
    import torch
    import triton

    try:
        from importlib.metadata import version

        fg_version: str | None = version("flag_gems")
    except Exception:
        try:
            import flag_gems

            fg_version = str(flag_gems.__version__)
        except Exception:
            fg_version = None
    props = _device_props(device_index)
    vendor, toolkit = _vendor_and_toolkit()
    return {
        "vendor": vendor,
        "device_name": props["name"],
        "arch": f"sm_{props['major']}{props['minor']}" if vendor == "nvidia" else
        f"{props['major']}.{props['minor']}",
        "sm_count": int(props["sm_count"]),
        "smem_per_block": int(props["smem_per_block"]) if props["smem_per_block"] else None,
        "warp_size": int(props["warp_size"]) if props["warp_size"] else None,
        "driver": _driver_version(),
        "toolkit": toolkit,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "flag_gems": fg_version,
        "kernel_source_hash": kernel_source_hash(),
    }  # fmt: skip


def live_profile_fields(device_index: int = 0) -> dict[str, Any]:
    """The device's resource limits as the fields of ``mxdb.profiles.DeviceProfile``."""
    from mxdb.profiles import profile_for_device_name

    c = live_fingerprint_components(device_index)
    props = _device_props(device_index)
    known = profile_for_device_name(c["device_name"] or "")
    vendor = c["vendor"] if c["vendor"] in ("nvidia", "metax") else "other"
    regs_per_sm = props.get("regs_per_sm")
    return {
        "name": known.name if known is not None else "live",
        "device_name": c["device_name"],
        "vendor": vendor,
        "arch": c["arch"],
        "sm_count": c["sm_count"],
        "smem_per_block": c["smem_per_block"],
        "smem_per_sm": props.get("smem_per_sm"),
        "warp_size": c["warp_size"],
        "max_threads_per_block": 1024,
        "regs_per_thread": 255,
        "regs_per_sm": int(regs_per_sm) if regs_per_sm else 65536,
        # Hopper warp-group MMA; Triton lowers a dot to it on sm_90 (sm_90a)
        "wgmma": c["arch"] == "sm_90",
        # Triton 3.x's pipeliner on NVIDIA was measured (survey of vLLM's grid); mcTriton's
        # rule is calibrated on the recorded C500 failure; others were never measured
        "smem_buffer_rule": {"nvidia": "nvidia", "metax": "mctriton"}.get(vendor, "num_stages"),
        "notes": (
            f"read live from torch.cuda.get_device_properties({device_index}) and Triton's "
            f"driver (torch {c['torch']}, triton {c['triton']})"
        ),
    }


def live_profile(device_index: int = 0) -> Any:
    """The live device as ``mxdb.profiles.DeviceProfile``."""
    from mxdb.profiles import DeviceProfile

    return DeviceProfile(**live_profile_fields(device_index))
