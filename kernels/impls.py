"""The implementations of each decode op, and which of them this process can run.

For every op: ``torch`` (always available, the exact unfused Hugging Face chain, the CPU path),
``fused`` (mxdb's Triton kernels, when CUDA and Triton are usable) and ``flaggems`` (FlagGems'
kernels, when ``flag_gems`` imports).  All share one signature per op:

* ``rms_norm(x, weight, eps) -> y``
* ``add_rms_norm(x, residual, weight, eps) -> (y, new_residual)``
* ``rope(q, k, cos, sin) -> (q, k)`` with ``q``/``k`` ``[B, H, S, D]`` and ``cos``/``sin``
  ``[B, S, D]``
* ``masked_softmax(scores, mask, scale) -> probs``
* ``swiglu(gate, up) -> out``

torch and the kernels are imported on first use only.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any

#: The decode ops, in the order a decoder layer runs them.
DECODE_OPS: tuple[str, ...] = ("rms_norm", "add_rms_norm", "rope", "masked_softmax", "swiglu")
#: Implementation names a decision may choose.
IMPLS: tuple[str, ...] = ("fused", "flaggems", "torch")


def torch_impls() -> dict[str, Callable[..., Any]]:
    from mxdb.kernels import decode_ref

    return {op: getattr(decode_ref, op) for op in DECODE_OPS}


@functools.cache
def fused_usable() -> bool:
    """CUDA is available and Triton imports (compiling happens on first call)."""
    if importlib.util.find_spec("triton") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


@functools.cache
def flaggems_usable() -> bool:
    if importlib.util.find_spec("flag_gems") is None:
        return False
    try:
        import flag_gems  # noqa: F401
    except Exception:  # a broken install is an unusable one
        return False
    import torch

    return bool(torch.cuda.is_available())


def fused_impls() -> dict[str, Callable[..., Any]]:
    from mxdb.kernels import decode_ops

    return dict(decode_ops.OPS)


def flaggems_impls() -> dict[str, Callable[..., Any]]:
    from mxdb.kernels import decode_flaggems

    ops: dict[str, Callable[..., Any]] = decode_flaggems.flaggems_ops()
    return ops


def available(
    *, fused: bool | None = None, flaggems: bool | None = None
) -> dict[str, dict[str, Any]]:
    """``{impl: {op: callable}}`` for the implementations usable here (torch always)."""
    out: dict[str, dict[str, Any]] = {"torch": torch_impls()}
    if fused if fused is not None else fused_usable():
        out["fused"] = fused_impls()
    if flaggems if flaggems is not None else flaggems_usable():
        out["flaggems"] = flaggems_impls()
    return out
