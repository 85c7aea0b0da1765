"""Which fingerprint is "this host": the live one on a GPU host, the GPU-free one elsewhere.

The tuner records entries under the live fingerprint (device facts read through torch and the
driver).  A command that answers for this host (``mxdb fingerprint``, ``mxdb dispatch``,
``mxdb drift check``) must use the same one, or a GPU host disagrees with its own store.

Reading the live fingerprint imports torch, which the GPU-free core promises not to do on a
host without a GPU.  So a GPU host is first *detected* without importing anything: a device
node of the NVIDIA or MetaX driver, the NVIDIA driver's ``/proc`` entry, or a vendor SMI tool
on the path.  Only then is the GPU layer (``mxdb.kernels.live``) imported, lazily.  When it
cannot read a device (torch without CUDA, no GPU layer installed) the GPU-free fingerprint
is used and the reason is kept.

``$MXDB_FINGERPRINT`` (a recorded fingerprint file) overrides everything; ``$MXDB_GPU_HOST``
set to ``0`` or ``1`` overrides the detection (``0``: treat this host as GPU-free).
"""

from __future__ import annotations

import glob
import os
import shutil
from dataclasses import dataclass
from typing import Any

from mxdb.fingerprint import (
    collect,
    diff,
    environment_data,
    fingerprint_document,
    load_fingerprint,
)
from mxdb.models import Fingerprint
from mxdb.version import __version__

#: Files whose presence says a GPU driver is loaded (NVIDIA; MetaX's device node).
DEVICE_FILES: tuple[str, ...] = (
    "/dev/nvidiactl",
    "/proc/driver/nvidia/version",
    "/dev/mxcd",
)
#: Device-node patterns of individual GPUs.
DEVICE_GLOBS: tuple[str, ...] = ("/dev/nvidia[0-9]*", "/dev/mxgpu*")
#: Vendor tools whose presence on the path marks a GPU host.
SMI_TOOLS: tuple[str, ...] = ("nvidia-smi", "mx-smi")


def gpu_host_evidence() -> str | None:
    """What says this host has a GPU (a path or tool name), or None; imports nothing."""
    flag = os.environ.get("MXDB_GPU_HOST", "").strip()
    if flag in ("0", "1"):
        return "MXDB_GPU_HOST=1" if flag == "1" else None
    for path in DEVICE_FILES:
        if os.path.exists(path):
            return path
    for pattern in DEVICE_GLOBS:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    for tool in SMI_TOOLS:
        where = shutil.which(tool)
        if where:
            return where
    return None


@dataclass(frozen=True)
class HostFingerprint:
    """This host's fingerprint and where it came from."""

    fingerprint: Fingerprint
    #: ``recorded`` ($MXDB_FINGERPRINT), ``live`` (GPU facts read through the GPU layer) or
    #: ``offline`` (what is knowable without a GPU)
    source: str
    #: why this source: the detection evidence, or why the live one could not be read
    note: str


def host_fingerprint(*, offline: bool = False) -> HostFingerprint:
    """This host's fingerprint: see the module docstring.

    ``offline`` gives the GPU-free one even on a GPU host (and never imports torch).
    """
    path = os.environ.get("MXDB_FINGERPRINT")
    if path:
        return HostFingerprint(load_fingerprint(path), "recorded", f"MXDB_FINGERPRINT={path}")
    if offline:
        return HostFingerprint(collect(), "offline", "--offline")
    evidence = gpu_host_evidence()
    if evidence is None:
        return HostFingerprint(collect(), "offline", "no GPU detected on this host")
    try:
        from mxdb.kernels.live import live_fingerprint_components

        # exactly what the tuner records (GpuBackend.fingerprint): the live components
        # and mxdb's version
        live = Fingerprint(**{**live_fingerprint_components(), "mxdb": __version__})
    except Exception as exc:  # torch without a usable device, or no GPU layer installed
        reason = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:200]
        return HostFingerprint(
            collect(), "offline", f"GPU detected ({evidence}) but not readable: {reason}"
        )
    return HostFingerprint(live, "live", f"read live (GPU detected: {evidence})")


def describe(
    other: str | os.PathLike[str] | None = None, *, offline: bool = False
) -> dict[str, Any]:
    """This host's fingerprint as a document, and its changes against a recorded one.

    This host's is :func:`host_fingerprint`: live on a GPU host, GPU-free with
    ``offline`` or without a GPU.  Returns ``{"fingerprint": {...components, hash},
    "source", "note", "absent": [...], "diff_against": path | None,
    "changes": [{component, old, new}, ...]}``.
    """
    host = host_fingerprint(offline=offline)
    current = host.fingerprint
    result: dict[str, Any] = {
        "fingerprint": fingerprint_document(current),
        "source": host.source,
        "note": host.note,
        "absent": current.absent(),
        "diff_against": None,
        "changes": [],
        "data": environment_data(),
    }
    if other is not None:
        recorded_fp = load_fingerprint(other)
        result["diff_against"] = str(other)
        result["recorded_hash"] = recorded_fp.hash
        result["changes"] = [c.model_dump() for c in diff(recorded_fp, current)]
    return result
