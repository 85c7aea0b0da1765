"""The lean MoE layer's per-call path, free of torch: workspaces per token count, launch plans.

This module imports neither torch nor triton, so the per-call Python path of
:class:`~mxdb.kernels.layer.MoELayer` can be driven (and its host cost measured) with fake
tensors and fake launchers on a machine without a GPU (``benchmarks/bench_layer_host.py``).

* :class:`LaunchPlan`: a fixed sequence of launches.  Every launch's argument list is built once;
  a call only writes the call's tensors (``x``, ``topk_weights``, ``topk_ids``, ``out``) and the
  current stream into their slots and calls each launcher.  No config lookup, no allocation, no
  host synchronization.
* :class:`LeanLayer`: one workspace (a :class:`LaunchPlan` or any callable of the same form) per
  token count M.  The first call at M asks ``config_for(M)`` once and builds the workspace;
  every later call at M is one dict lookup and the workspace call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

#: Input slots a launch argument can be bound to, in the order a call passes them.
X, TOPK_WEIGHTS, TOPK_IDS, OUT = 0, 1, 2, 3

#: One launch: (launcher, its argument list, (argument position, input slot) pairs,
#: argument position of the stream or -1).
Step = tuple[Callable[..., Any], list[Any], tuple[tuple[int, int], ...], int]

Workspace = Callable[[Any, Any, Any, Any], Any]
ConfigFor = Callable[[int], Any]


class LaunchPlan:
    """A fixed launch sequence over fixed buffers; ``plan(x, tw, ids, out=None) -> out``."""

    __slots__ = ("out", "steps", "stream_fn")

    def __init__(
        self,
        steps: Sequence[Step],
        out: Any,
        stream_fn: Callable[[], Any] | None = None,
    ) -> None:
        self.steps = tuple(steps)
        self.out = out
        self.stream_fn = stream_fn

    def __call__(self, x: Any, tw: Any, ids: Any, out: Any = None) -> Any:
        res = self.out if out is None else out
        inputs = (x, tw, ids, res)
        stream = self.stream_fn() if self.stream_fn is not None else None
        for fn, args, binds, spos in self.steps:
            for pos, src in binds:
                args[pos] = inputs[src]
            if spos >= 0:
                args[spos] = stream
            fn(*args)
        return res

    @property
    def launches(self) -> int:
        """How many launcher calls one layer call makes."""
        return len(self.steps)


class LeanLayer:
    """Workspaces per token count, built on first use from ``config_for`` and ``build``.

    ``build(tokens, config, x, tw, ids)`` returns the workspace for ``tokens`` (it may run the
    layer once on the given inputs to warm up and record its launches); ``default_config(tokens)``
    answers when ``config_for`` is absent or returns ``None``.
    """

    def __init__(
        self,
        build: Callable[[int, Any, Any, Any, Any], Workspace],
        config_for: ConfigFor | None = None,
        default_config: ConfigFor | None = None,
    ) -> None:
        self._build = build
        self.config_for = config_for
        self._default_config = default_config
        self._ws: dict[int, Workspace] = {}
        self.configs: dict[int, Any] = {}

    def config_at(self, tokens: int) -> Any:
        """The config a call at ``tokens`` uses (asked once per token count)."""
        cfg = self.configs.get(tokens)
        if cfg is None:
            cfg = self.config_for(tokens) if self.config_for is not None else None
            if cfg is None and self._default_config is not None:
                cfg = self._default_config(tokens)
            self.configs[tokens] = cfg
        return cfg

    def workspace(self, tokens: int) -> Workspace | None:
        """The workspace built for ``tokens``, or ``None`` before the first call at it."""
        return self._ws.get(tokens)

    def set_workspace(self, tokens: int, ws: Workspace) -> None:
        """Replace the workspace for ``tokens`` (a graphed call replacing its plan, say)."""
        self._ws[tokens] = ws

    def _first_call(self, tokens: int, x: Any, tw: Any, ids: Any) -> Workspace:
        ws = self._build(tokens, self.config_at(tokens), x, tw, ids)
        self._ws[tokens] = ws
        return ws

    def __call__(self, x: Any, topk_weights: Any, topk_ids: Any, out: Any = None) -> Any:
        m = x.shape[0]
        ws = self._ws.get(m)
        if ws is None:
            ws = self._first_call(m, x, topk_weights, topk_ids)
        return ws(x, topk_weights, topk_ids, out)
