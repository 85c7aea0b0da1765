"""``MoELayer``: the lean runtime MoE layer that the dispatcher's configs feed.

Built once per (shape family, dtype, device) from the expert weights; called with
``(x, topk_weights, topk_ids)``.  The first call at a token count M asks ``config_for(M)`` once
(``None`` means FlagGems' own choice for that call) and builds that M's workspace, a
:class:`~mxdb.kernels.pipeline.MoEPipeline`; every later call at M goes straight to it: no
config lookup, no allocation, no host synchronization, so the call can itself be captured in
the caller's CUDA graph.

With ``graphs=True`` the layer keeps its own CUDA graph per M (captured on the second call at
that M, after a warm-up call): a call then copies its inputs into the graph's static buffers and
replays it, one launch for the whole layer instead of about ten.  Do not use ``graphs=True``
inside a caller's own graph capture.

The returned tensor is the workspace's output buffer: the next call at the same M overwrites it
(pass ``out=`` to keep results).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from mxdb.kernels.pipeline import MoEPipeline
from mxdb.kernels.timing import capture

from mxdb.configs import KernelConfig
from mxdb.shapes import MoEShape, canonical_dtype

ConfigFor = Callable[[int], "KernelConfig | None"]


class _GraphedCall:
    """One M's pipeline replayed from a CUDA graph over static input buffers."""

    def __init__(
        self, pipe: MoEPipeline, x: torch.Tensor, tw: torch.Tensor, ids: torch.Tensor
    ) -> None:
        self.x = x.clone()
        self.tw = tw.clone()
        self.ids = ids.clone()
        self.pipe = pipe
        self.graph = capture(lambda: pipe(self.x, self.tw, self.ids), 1)

    def __call__(self, x: torch.Tensor, tw: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        self.x.copy_(x)
        self.tw.copy_(tw)
        self.ids.copy_(ids)
        self.graph.replay()
        return self.pipe.out


class MoELayer:
    """The MoE layer for one family, with a config per token count from ``config_for``."""

    def __init__(
        self,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk: int,
        config_for: ConfigFor | None = None,
        *,
        graphs: bool = False,
    ) -> None:
        e, two_i, h = w1.shape
        self.family_shape = MoEShape(e, h, two_i // 2, topk, 1, canonical_dtype(w1.dtype))
        self.w1 = w1.contiguous()
        self.w2 = w2.contiguous()
        self.topk = topk
        self.config_for = config_for
        self.graphs = graphs
        self._pipes: dict[int, MoEPipeline] = {}
        self._graphed: dict[int, _GraphedCall] = {}
        self._seen: dict[int, int] = {}

    def config_at(self, tokens: int) -> KernelConfig:
        """The config a call at ``tokens`` uses (asked once per token count)."""
        cfg = self.config_for(tokens) if self.config_for is not None else None
        if cfg is None:
            from mxdb.kernels.backend import flaggems_config

            from mxdb.configs import GemmConfig

            raw = flaggems_config(self.family_shape.with_tokens(tokens))
            gemm = GemmConfig.from_triton({k: v for k, v in raw.items() if k != "SWAP_AB"})
            cfg = KernelConfig.uniform(gemm)
        return cfg

    def workspace(self, tokens: int) -> MoEPipeline:
        """The pipeline (buffers and launches) for ``tokens`` tokens, built on first use."""
        pipe = self._pipes.get(tokens)
        if pipe is None:
            shape = self.family_shape.with_tokens(tokens)
            pipe = MoEPipeline(shape, self.config_at(tokens), self.w1, self.w2)
            self._pipes[tokens] = pipe
        return pipe

    def __call__(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        m = x.shape[0]
        if self.graphs:
            g = self._graphed.get(m)
            if g is not None:
                res = g(x, topk_weights, topk_ids)
                return res if out is None else out.copy_(res)
            pipe = self.workspace(m)
            if self._seen.get(m, 0) >= 1:  # warmed up: capture now
                self._graphed[m] = _GraphedCall(pipe, x, topk_weights, topk_ids)
                res = self._graphed[m](x, topk_weights, topk_ids)
                return res if out is None else out.copy_(res)
            self._seen[m] = 1
            return pipe(x, topk_weights, topk_ids, out)
        pipe = self._pipes.get(m) or self.workspace(m)
        return pipe(x, topk_weights, topk_ids, out)
