"""``MoELayer``: the lean runtime MoE layer that the dispatcher's configs feed.

Built once per (shape family, dtype, device) from the expert weights; called with
``(x, topk_weights, topk_ids)``.  The first call at a token count M asks ``config_for(M)`` once
(``None`` means FlagGems' own choice for that call; :func:`mxdb.dispatcher.dispatch_config_for`
wires a :class:`mxdb.dispatcher.Dispatcher` or ``mxdb.dispatch``) and builds that M's workspace: a
:class:`~mxdb.kernels.pipeline.MoEPipeline` (every buffer, the alignment's scratch included),
run once to compile and autotune, then recorded into a :class:`~mxdb.kernels.lean.LaunchPlan`.

The plan replays each Triton launch through Triton's compiled launcher directly, with the
argument list built once: a call writes only its tensors and the current stream into their slots.
This skips Triton's per-launch binding and cache-key work, FlagGems' wrappers (logging, its
pointwise wrapper around the activation, the autotuner's lookup for ``moe_sum``) and the
alignment's scratch allocations.  A call makes these launches and nothing else: no config
lookup, no allocation, no host synchronization; it can be captured in the caller's CUDA graph.
Launches per call: 4 for sparse batches (GEMM1, activation, GEMM2, sum); 9 otherwise (memset of
the alignment counts and FlagGems' 4 alignment stages before them), plus one copy per GEMM whose
``block_m`` is below ``align_block``.

With ``graphs=True`` the layer keeps its own CUDA graph per M (captured on the second call at
that M): a call then copies its inputs into the graph's static buffers and replays it.  Do not
use ``graphs=True`` inside a caller's own graph capture.

The returned tensor is the workspace's output buffer: the next call at the same M overwrites it
(pass ``out=`` to keep results).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from mxdb.kernels.lean import OUT, TOPK_IDS, TOPK_WEIGHTS, LaunchPlan, LeanLayer, Step, X
from mxdb.kernels.pipeline import MoEPipeline
from mxdb.kernels.timing import capture

from mxdb.configs import GemmConfig, KernelConfig
from mxdb.shapes import MoEShape, canonical_dtype

ConfigFor = Callable[[int], "KernelConfig | None"]


def flaggems_kernel_config(shape: MoEShape) -> KernelConfig:
    """FlagGems 5.0.2's own choice for ``shape`` as a :class:`KernelConfig` (both GEMMs)."""
    from mxdb.kernels.backend import flaggems_config

    raw = flaggems_config(shape)
    return KernelConfig.uniform(
        GemmConfig.from_triton({k: v for k, v in raw.items() if k != "SWAP_AB"})
    )


def record_plan(
    pipe: MoEPipeline, x: torch.Tensor, tw: torch.Tensor, ids: torch.Tensor
) -> LaunchPlan:
    """Record one call of ``pipe`` (already warmed up) into a :class:`LaunchPlan`.

    Each Triton launch is captured at Triton's launcher (``driver.active.launcher_cls``) with its
    grid and argument list; the call's own tensors are found in the list by identity and become
    slots of the plan.  Triton launch hooks (profilers) are not called by the replay.  Raises
    ``RuntimeError`` when a step launched nothing or Triton's argument layout is not the flat one
    this recorder knows: the caller then keeps the pipeline.
    """
    from mxdb.kernels.decode_launch import record
    from triton.runtime import driver

    cls = driver.active.launcher_cls
    slots = ((X, x), (TOPK_WEIGHTS, tw), (TOPK_IDS, ids), (OUT, pipe.out))
    steps: list[Step] = []
    for kind, thunk in pipe.steps(x, tw, ids, pipe.out):
        if kind == "torch":
            steps.append((thunk, [], (), -1))
            thunk()
            continue
        seen, _ = record(cls, thunk)
        if not seen:
            raise RuntimeError(f"step {len(steps)} launched no Triton kernel")
        for launcher, call, _ in seen:
            # a launcher call: grid x, y, z, stream, function, then the launcher's arguments
            gx, gy, gz, _stream, function, *rest = call
            args = tuple(rest)
            if any(isinstance(a, (tuple, list)) for a in args[4:]):
                # A newer Triton packs the kernel arguments into one tuple: the call's tensors
                # would not be found by identity and the replay would reuse the recording's.
                raise RuntimeError(
                    "Triton passed the kernel arguments in a layout this recorder does not "
                    "know (nested); keeping the pipeline"
                )
            scratch = getattr(launcher, "global_scratch_size", 0) or getattr(
                launcher, "profile_scratch_size", 0
            )
            if scratch or not hasattr(launcher, "launch"):
                fn: Callable[..., Any] = launcher
                head: list[Any] = [gx, gy, gz, None, function]
            else:
                fn = launcher.launch
                head = [
                    gx, gy, gz, None, function,
                    launcher.launch_cooperative_grid, launcher.launch_pdl, None, None,
                ]  # fmt: skip
            # args: packed metadata, launch metadata, enter hook, exit hook, kernel arguments;
            # the plan replays without launch hooks (their metadata would be the recording's)
            args = (args[0], None, None, None, *args[4:])
            full = head + list(args)
            binds = tuple(
                (len(head) + j, slot) for j, a in enumerate(args) for slot, t in slots if a is t
            )
            steps.append((fn, full, binds, 3))
    stream_fn = functools.partial(torch._C._cuda_getCurrentRawStream, x.device.index)
    return LaunchPlan(steps, pipe.out, stream_fn)


class _GraphSlot:
    """Graph mode for one M: runs the plan on the first call, captures a graph on the second."""

    def __init__(self, layer: MoELayer, tokens: int, plan: Any) -> None:
        self.layer, self.tokens, self.plan = layer, tokens, plan

    def __call__(self, x: torch.Tensor, tw: torch.Tensor, ids: torch.Tensor, out: Any) -> Any:
        g = _GraphedCall(self.plan, x, tw, ids)
        self.layer.set_workspace(self.tokens, g)
        return g(x, tw, ids, out)


class _GraphedCall:
    """One M's plan replayed from a CUDA graph over static input buffers."""

    def __init__(self, plan: Any, x: torch.Tensor, tw: torch.Tensor, ids: torch.Tensor) -> None:
        self.x, self.tw, self.ids = x.clone(), tw.clone(), ids.clone()
        self.plan = plan
        self.graph = capture(lambda: plan(self.x, self.tw, self.ids), 1)

    def __call__(
        self, x: torch.Tensor, tw: torch.Tensor, ids: torch.Tensor, out: Any = None
    ) -> Any:
        self.x.copy_(x)
        self.tw.copy_(tw)
        self.ids.copy_(ids)
        self.graph.replay()
        res = self.plan.out
        return res if out is None else out.copy_(res)


class MoELayer(LeanLayer):
    """The MoE layer for one family, with a config per token count from ``config_for``."""

    def __init__(
        self,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk: int,
        config_for: ConfigFor | None = None,
        *,
        graphs: bool = False,
        record: bool = True,
    ) -> None:
        e, two_i, h = w1.shape
        self.family_shape = MoEShape(e, h, two_i // 2, topk, 1, canonical_dtype(w1.dtype))
        self.w1 = w1.contiguous()
        self.w2 = w2.contiguous()
        self.topk = topk
        self.graphs = graphs
        self.record = record
        self.pipelines: dict[int, MoEPipeline] = {}
        self.record_errors: dict[int, str] = {}
        super().__init__(
            self._build_workspace,
            config_for,
            lambda m: flaggems_kernel_config(self.family_shape.with_tokens(m)),
        )

    def _build_workspace(
        self,
        tokens: int,
        config: KernelConfig,
        x: torch.Tensor,
        tw: torch.Tensor,
        ids: torch.Tensor,
    ) -> Any:
        pipe = MoEPipeline(self.family_shape.with_tokens(tokens), config, self.w1, self.w2)
        self.pipelines[tokens] = pipe
        ws: Any = pipe
        if self.record:
            pipe(x, tw, ids)  # compile, load modules and autotune moe_sum before recording
            try:
                ws = record_plan(pipe, x, tw, ids)
            except Exception as exc:  # keep the (slower) pipeline: results are the same
                self.record_errors[tokens] = f"{type(exc).__name__}: {exc}"
        if self.graphs:
            return _GraphSlot(self, tokens, ws)
        return ws

    def launches(self, tokens: int) -> int | None:
        """Launcher calls per layer call at ``tokens`` (``None`` before it is built or unrecorded)."""
        ws = self.workspace(tokens)
        plan = ws.plan if isinstance(ws, (_GraphSlot, _GraphedCall)) else ws
        return plan.launches if isinstance(plan, LaunchPlan) else None
