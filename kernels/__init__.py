"""The GPU layer of mxdb (torch, triton, flag_gems), importable as ``mxdb.kernels``.

Importing this package imports nothing heavy: torch, triton and flag_gems load when one of the
functions below (or a submodule) is first used.

* :mod:`mxdb.kernels.pipeline`: the MoE layer on FlagGems' kernels with an injected config;
* :mod:`mxdb.kernels.reference`: the float32 reference, inputs and correctness thresholds;
* :mod:`mxdb.kernels.timing`: interleaved CUDA-graph / eager timing;
* :mod:`mxdb.kernels.compile`: parallel compilation in worker processes;
* :mod:`mxdb.kernels.backend`: ``GpuBackend``, the tuner's measuring device;
* :mod:`mxdb.kernels.live`: the live fingerprint and device profile.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GpuBackend", "live_fingerprint_components", "live_profile"]


def live_profile(device_index: int = 0) -> Any:
    """The live device's ``mxdb.profiles.DeviceProfile``."""
    from mxdb.kernels.live import live_profile as _live_profile

    return _live_profile(device_index)


def live_fingerprint_components(device_index: int = 0) -> dict[str, Any]:
    """The live environment's fingerprint components (all but ``mxdb``)."""
    from mxdb.kernels.live import live_fingerprint_components as _components

    return dict(_components(device_index))


def __getattr__(name: str) -> Any:
    if name == "GpuBackend":
        from mxdb.kernels.backend import GpuBackend

        return GpuBackend
    raise AttributeError(f"module 'mxdb.kernels' has no attribute {name!r}")
