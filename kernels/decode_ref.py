"""PyTorch references of the fused decode ops: the exact unfused chains Hugging Face models run.

Each function computes what the unfused ``transformers`` code computes, rounding where it
rounds, so that the ``torch`` implementation of an op through the dispatcher reproduces the
stock model bit for bit.  ``*_fp32`` variants compute the same math entirely in float32: the
yardstick the kernels' errors are measured against.

* ``rms_norm(x, w, eps)``: ``w * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``
* ``add_rms_norm(x, residual, w, eps)``: ``h = residual + x`` (rounded to the model dtype),
  returns ``(rms_norm(h), h)``
* ``rope(q, k, cos, sin)``: ``q * cos + rotate_half(q) * sin`` with ``cos``/``sin`` of shape
  ``[B, S, D]`` broadcast over the heads of ``q``/``k`` ``[B, H, S, D]``
* ``masked_softmax(scores, mask, scale)``: ``softmax(scores * scale + mask, float32).to(dtype)``
* ``swiglu(gate, up)``: ``silu(gate) * up``
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    return weight * h.to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    h = residual + x
    return rms_norm(h, weight, eps), h


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    s = scores * scale
    if mask is not None:
        s = s + mask
    return torch.nn.functional.softmax(s, dim=-1, dtype=torch.float32).to(scores.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


# -- float32 yardsticks -----------------------------------------------------------------------


def rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return weight.float() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def add_rms_norm_fp32(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # the residual is rounded to the model dtype in the unfused chain too: that is the contract
    h = (residual + x).float()
    return rms_norm_fp32(h, weight, eps), h


def rope_fp32(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return rope(q.float(), k.float(), cos.float(), sin.float())


def masked_softmax_fp32(
    scores: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    s = scores.float() * scale
    if mask is not None:
        s = s + mask.float()
    return torch.softmax(s, dim=-1)


def swiglu_fp32(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate.float()) * up.float()
