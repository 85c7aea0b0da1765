"""FlagGems' decode ops behind mxdb's op signatures (those of :mod:`mxdb.kernels.impls`).

``flaggems_ops()`` adapts FlagGems 5.0.2 (``flag_gems.ops.rms_norm``,
``flag_gems.fused.fused_add_rms_norm`` (in place: it is given copies),
``flag_gems.fused.apply_rotary_pos_emb``, ``flag_gems.ops.softmax`` after a torch scale + mask,
``flag_gems.fused.silu_and_mul``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from mxdb.kernels import decode_ref


def flaggems_ops() -> dict[str, Callable[..., Any]]:
    import flag_gems
    from flag_gems import fused as fg_fused
    from flag_gems import ops as fg_ops

    def rms_norm(x: Any, w: Any, eps: float) -> Any:
        if w.dtype != x.dtype:  # FlagGems writes x's dtype; keep the model's promotion
            return decode_ref.rms_norm(x, w, eps)
        return fg_ops.rms_norm(x, [x.shape[-1]], w, eps)

    def add_rms_norm(x: Any, r: Any, w: Any, eps: float) -> Any:
        # FlagGems normalizes the float32 sum (the residual it writes is rounded separately)
        y, h = fg_fused.fused_add_rms_norm(x.clone(), r.clone(), [x.shape[-1]], w, eps)
        return y, h

    def rope(q: Any, k: Any, cos: Any, sin: Any) -> Any:
        bsz, _, seq, d = q.shape
        half = d // 2
        c = cos.expand(bsz, seq, d)[..., :half].reshape(bsz * seq, half).contiguous()
        s = sin.expand(bsz, seq, d)[..., :half].reshape(bsz * seq, half).contiguous()
        pos = torch.arange(bsz * seq, device=q.device).view(bsz, seq)
        qt = q.transpose(1, 2)
        kt = k.transpose(1, 2)
        qo, ko = fg_fused.apply_rotary_pos_emb(qt, kt, c, s, pos, rotary_interleaved=False)
        return qo.transpose(1, 2), ko.transpose(1, 2)

    def masked_softmax(scores: Any, mask: Any, scale: float) -> Any:
        x = scores.float() * scale
        if mask is not None:
            x = x + mask
        return fg_ops.softmax(x, -1, False).to(scores.dtype)

    def swiglu(gate: Any, up: Any) -> Any:
        return fg_fused.silu_and_mul(gate, up)

    del flag_gems
    return {
        "rms_norm": rms_norm,
        "add_rms_norm": add_rms_norm,
        "rope": rope,
        "masked_softmax": masked_softmax,
        "swiglu": swiglu,
    }
