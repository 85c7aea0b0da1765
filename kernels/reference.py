"""A float32 PyTorch reference of the MoE layer, inputs for it, and the correctness thresholds.

The reference computes, for every token t and each of its k experts e with weight w:
``out[t] += w * (silu(x[t] @ w1[e, :I].T) * (x[t] @ w1[e, I:].T)) @ w2[e].T``, all in float32
(IEEE float32 matrix products: TF32 is switched off for the computation).

Thresholds.  The fused kernel rounds to the layer's dtype after GEMM1, after the activation and
after GEMM2 (before the sum over k), so its error is a few units in the last place of the output.
Inputs are scaled so that outputs are of order 1 (``x ~ N(0,1)``, ``w1 ~ N(0,1/H)``,
``w2 ~ N(0,1/I)``).  A result passes when it is finite and

* ``max |out - ref| <= ABS_TOL[dtype] * max(1, max |ref|)``, and
* ``||out - ref||_2 / ||ref||_2 <= REL_TOL[dtype]``.

``ABS_TOL`` is four times the C500 milestone's measured maximum error (2**-10 in fp16, 2**-7 in
bf16): 2**-8 for fp16, 2**-5 for bf16; ``REL_TOL`` is 2e-3 for fp16 and 1.6e-2 for bf16 (about
two units of the dtype's relative precision, 2**-10 and 2**-7).  float32 layers use 1e-4 and 1e-4.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mxdb.shapes import MoEShape

ABS_TOL: dict[str, float] = {"fp16": 2.0**-8, "bf16": 2.0**-5, "fp32": 1e-4}
REL_TOL: dict[str, float] = {"fp16": 2e-3, "bf16": 1.6e-2, "fp32": 1e-4}


@contextlib.contextmanager
def _ieee_fp32() -> Iterator[None]:
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


def moe_reference(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The MoE layer in float32: ``[M, H]``, float32, on the inputs' device."""
    m, h = x.shape
    inter = w2.shape[2]
    k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1).long()
    token_of_slot = torch.arange(m, device=x.device).repeat_interleave(k)
    weights = topk_weights.reshape(-1).float()
    xf = x.float()
    out = torch.zeros((m, h), dtype=torch.float32, device=x.device)
    with _ieee_fp32():
        for e in flat_ids.unique().tolist():
            slots = (flat_ids == e).nonzero().squeeze(1)
            rows = token_of_slot[slots]
            hidden = xf[rows] @ w1[e].float().t()
            act = F.silu(hidden[:, :inter]) * hidden[:, inter:]
            y = act @ w2[e].float().t()
            out.index_add_(0, rows, y * weights[slots, None])
    return out


@dataclass(frozen=True)
class ErrorReport:
    """Output vs reference."""

    max_abs_err: float
    rel_err: float
    threshold_abs: float
    threshold_rel: float
    passed: bool


def compare(out: torch.Tensor, ref: torch.Tensor, dtype: str) -> ErrorReport:
    """Compare a layer output with the float32 reference under ``dtype``'s thresholds."""
    diff = out.float() - ref
    finite = bool(torch.isfinite(out).all())
    max_abs = float(diff.abs().max()) if finite else float("inf")
    ref_norm = float(ref.norm())
    rel = float(diff.norm()) / ref_norm if finite and ref_norm > 0 else float("inf")
    if finite and ref_norm == 0:
        rel = 0.0 if max_abs == 0 else float("inf")
    thr_abs = ABS_TOL[dtype] * max(1.0, float(ref.abs().max()))
    thr_rel = REL_TOL[dtype]
    passed = finite and max_abs <= thr_abs and rel <= thr_rel
    return ErrorReport(max_abs, rel, thr_abs, thr_rel, passed)


@dataclass
class MoEInputs:
    """One set of layer inputs on the GPU."""

    x: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor


def make_weights(
    shape: MoEShape, seed: int, device: torch.device | str = "cuda"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random expert weights (``w1 ~ N(0,1/H)``, ``w2 ~ N(0,1/I)``) from ``seed``."""
    from mxdb.kernels.pipeline import TORCH_DTYPES

    dtype = TORCH_DTYPES[shape.dtype]
    e, h, i = shape.experts, shape.hidden, shape.intermediate
    gen = torch.Generator(device=device).manual_seed(seed)
    w1 = torch.empty((e, 2 * i, h), dtype=dtype, device=device)
    w2 = torch.empty((e, h, i), dtype=dtype, device=device)
    # generate per expert in float32 to keep the temporary small
    for j in range(e):
        w1[j].copy_(torch.randn((2 * i, h), generator=gen, device=device) / h**0.5)
        w2[j].copy_(torch.randn((h, i), generator=gen, device=device) / i**0.5)
    return w1, w2


def make_activations(
    shape: MoEShape,
    seed: int,
    topk_ids: torch.Tensor,
    device: torch.device | str = "cuda",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x ~ N(0,1)``, softmax routing weights for the given ``topk_ids``, and the ids (int32)."""
    from mxdb.kernels.pipeline import TORCH_DTYPES

    dtype = TORCH_DTYPES[shape.dtype]
    m, h, k = shape.tokens, shape.hidden, shape.topk
    if tuple(topk_ids.shape) != (m, k):
        raise ValueError(f"topk_ids has shape {tuple(topk_ids.shape)}; {shape!r} needs {(m, k)}")
    gen = torch.Generator(device=device).manual_seed(seed + 1_000_003)
    x = torch.randn((m, h), generator=gen, device=device).to(dtype)
    logits = torch.randn((m, k), generator=gen, device=device)
    topk_weights = torch.softmax(logits, dim=-1).float().contiguous()
    ids = topk_ids.to(device=device, dtype=torch.int32).contiguous()
    if int(ids.min()) < 0 or int(ids.max()) >= shape.experts:
        raise ValueError(f"topk_ids must lie in [0, {shape.experts}), got {int(ids.min())}..")
    return x, topk_weights, ids


def random_topk_ids(
    shape: MoEShape, seed: int, device: torch.device | str = "cuda"
) -> torch.Tensor:
    """Uniform routing: k distinct experts per token."""
    gen = torch.Generator(device=device).manual_seed(seed + 7)
    scores = torch.rand((shape.tokens, shape.experts), generator=gen, device=device)
    return scores.topk(shape.topk, dim=-1).indices.to(torch.int32).contiguous()


def make_inputs(
    shape: MoEShape,
    seed: int,
    topk_ids: torch.Tensor | None = None,
    device: torch.device | str = "cuda",
) -> MoEInputs:
    """Weights, activations and routing for ``shape`` from ``seed`` (uniform routing if none)."""
    if topk_ids is None:
        topk_ids = random_topk_ids(shape, seed, device)
    w1, w2 = make_weights(shape, seed, device)
    x, tw, ids = make_activations(shape, seed, topk_ids, device)
    return MoEInputs(x, w1, w2, tw, ids)
