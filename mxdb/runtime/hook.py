"""The FlagGems hook: FlagGems' fused-MoE path takes its config from ``mxdb.dispatch``.

``install()`` replaces two functions of ``flag_gems.fused.fused_moe`` (and every re-export of
them in an imported ``flag_gems`` module):

- ``fused_experts_impl`` (which ``inplace_fused_experts``, ``outplace_fused_experts`` and the
  vLLM plugin call): a wrapper that works out the call's key (shape, dtype and the layer's
  routing class), asks the dispatcher, runs the routing monitor and the healing samples, then
  calls the original;
- ``try_get_optimal_moe_config`` (which ``fused_experts_impl`` looks up as a module global for
  every chunk): a wrapper that returns the dispatched config while the wrapped call is in
  progress on this thread, and FlagGems' own choice otherwise.

When the dispatcher has no confident answer (a fallback decision) the call runs FlagGems'
own choice.  Calls the store has no entries for are left to FlagGems unchanged: quantized
weights, an ``expert_map``, biases, an activation other than silu, or router weights on the
input.  ``uninstall()`` puts the original function objects back.

**The lean layer for every call mxdb can run** (``lean=True``, the default).  A call on CUDA
tensors with at most ``lean_max_tokens`` tokens runs through mxdb's lean layer
(``mxdb.kernels.layer.MoELayer``: FlagGems' kernels replayed from recorded launches, no config
lookup, no allocation, no logging on the call path): with the dispatched config, or, at a
fallback, with FlagGems' own choice for that call.  Results are those of FlagGems with the same
config.  One layer object per (weights, config) keeps a workspace per token count, so larger
token counts (prefill, where the host cost matters least and workspaces would be large) keep
FlagGems' path; so does a call whose lean layer cannot be built (the error is kept in
``lean_errors``).  ``lean=False`` keeps FlagGems' own path for every call mxdb can express.

**FlagGems' missing-table warning.**  FlagGems 5.0.2 logs "No embedded MoE configs for device
..." whenever it looks up its (absent) table.  While the hook supplies the config (a dispatched
call, a lean-layer call or build) a filter on FlagGems' fused-MoE logger drops exactly that
warning (and its per-key twin "No embedded MoE config for device=..."); FlagGems' own
fallback calls (``lean=False``) still log it.  The filter is removed by ``uninstall()``.

**Configs FlagGems cannot express.**  FlagGems uses one config dict for both GEMMs and aligns
to its ``BLOCK_SIZE_M``.  A verified ``KernelConfig`` whose GEMM2 differs from GEMM1, or whose
``align_block`` is not GEMM1's ``block_m``, is not representable; nor is one that names another
implementation than FlagGems' (``impl``, e.g. ``fused_act``).  Such a call goes through
mxdb's own pipeline (``mxdb.kernels.layer.MoELayer``, the kernels of the config's
implementation launched with the exact verified config): running GEMM1's config for both GEMMs would run a combination that was
never measured or verified.  ``split="gemm1"`` selects that approximation instead (counted as
``split_gemm1`` in ``stats()``); ``split="fallback"`` gives such calls FlagGems' own choice.

**No synchronization on the call path.**  The routing monitor copies a layer's top-k ids
every ``monitor_every`` calls with a non-blocking copy into pinned host memory and records a
CUDA event; a later call of that layer looks at ``event.query()`` and, once the copy is done,
classifies the ids and updates the layer's routing class.  Healing watches a key's
candidates: the store's alternatives (``Dispatcher.alternatives``), then FlagGems' own choice
for the shape (reason ``healing_fallback``), so a key whose only dispatched config degrades
can still fall back.  Healing samples (every
``healing.sample_every`` calls of a key) record two CUDA events around the call; their elapsed
time is read on a later sampled call once the end event has completed.

**CUDA-graph capture.**  While the current stream is capturing a graph
(``torch.cuda.is_current_stream_capturing()``), the hook queries no event, records none and
starts no copy: the routing monitor's copy and poll and the healing sample of that call are
skipped (counted as ``capture_deferred``), and the call runs with the dispatcher's current
decision.  That decision (the config, healing's current choice included) is baked into the
captured graph: every replay runs it, whatever the monitor or the healer decide later, until
the caller captures again.  Monitoring and healing resume on the next call outside capture
(eager calls keep sampling; replays are not seen by the hook).  Warm every token count up
eagerly before capturing it, as CUDA graphs require anyway: the first call at a token count
builds the lean layer's workspace, which compiles and loads kernels.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, cast

from mxdb.configs import KernelConfig
from mxdb.decision import FALLBACK, Decision
from mxdb.errors import MxdbError, UsageError
from mxdb.runtime.healing import Healer, HealingOptions
from mxdb.shapes import MoEShape, canonical_dtype

MODULE = "flag_gems.fused.fused_moe"
IMPL = "fused_experts_impl"
CONFIG_FN = "try_get_optimal_moe_config"
SPLIT_MODES = ("pipeline", "gemm1", "fallback")

#: Keyword arguments of fused_experts_impl that make a call one mxdb has no entries for.
_UNSUPPORTED_FLAGS = (
    "use_fp8_w8a8",
    "use_int8_w8a8",
    "use_int8_w8a16",
    "use_int4_w4a16",
    "ocp_mx_scheme",
    "per_channel_quant",
    "expert_map",
    "w1_scale",
    "w2_scale",
    "w1_zp",
    "w2_zp",
    "a1_scale",
    "a2_scale",
    "block_shape",
    "w1_bias",
    "w2_bias",
    "apply_router_weight_on_input",
)

#: A runner of mxdb's own layer: (x, topk_weights, topk_ids, inplace) -> out.
Runner = Callable[[Any, Any, Any, bool], Any]
#: Builds a runner for (w1, w2, topk, config); config None means FlagGems' own choice.
PipelineFactory = Callable[[Any, Any, int, "KernelConfig | None"], Runner]

#: The start of FlagGems' missing-table warnings ("No embedded MoE configs for device %s. ..."
#: and "No embedded MoE config for device=%s, key=%s. ...").
MISSING_TABLE_PREFIX = "No embedded MoE config"
#: FlagGems' loggers are children of this one.
FLAGGEMS_LOGGER = "flag_gems"


class MissingTableFilter(logging.Filter):
    """Drops FlagGems' missing-table warning while ``active()`` (the hook supplies the config)."""

    def __init__(self, active: Callable[[], bool]) -> None:
        super().__init__()
        self.active = active
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if (
            record.levelno == logging.WARNING
            and isinstance(record.msg, str)
            and record.msg.startswith(MISSING_TABLE_PREFIX)
            and self.active()
        ):
            self.dropped += 1
            return False
        return True


def _flaggems_loggers(module: Any) -> list[logging.Logger]:
    """The loggers FlagGems' fused-MoE code may log through.

    A logger's filters only see records logged on that logger itself (not its children's),
    so the filter goes on every logger of FlagGems that exists when the hook is installed
    (``flag_gems`` and its descendants) and on every module-level ``Logger`` of the
    fused-MoE module.
    """
    out = [logging.getLogger(FLAGGEMS_LOGGER)]
    known = list(logging.Logger.manager.loggerDict.items())
    for name, value in known:
        if name.startswith(FLAGGEMS_LOGGER + ".") and isinstance(value, logging.Logger):
            out.append(value)
    for value in list(vars(module).values()):
        if isinstance(value, logging.Logger) and value not in out:
            out.append(value)
    return out


class HostClock:
    """Timing and top-k copies for host-side tensors (CPU runs and tests): synchronous."""

    def capturing(self) -> bool:
        """Host tensors are never captured in a CUDA graph."""
        return False

    def mark(self) -> Any:
        return time.perf_counter()

    def ready(self, mark: Any) -> bool:
        return True

    def elapsed_us(self, start: Any, end: Any) -> float:
        return float(end - start) * 1e6

    def start_copy(self, ids: Any) -> Any:
        import numpy as np

        return np.array(ids, dtype=np.int64, copy=True)

    def copy_ready(self, handle: Any) -> bool:
        return True

    def copy_result(self, handle: Any) -> Any:
        return handle


class CudaClock:
    """CUDA events and pinned non-blocking copies: nothing here waits for the GPU."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.capturing = torch.cuda.is_current_stream_capturing

    def mark(self) -> Any:
        ev = self.torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def ready(self, mark: Any) -> bool:
        return bool(mark.query())

    def elapsed_us(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end)) * 1000.0

    def start_copy(self, ids: Any) -> Any:
        torch = self.torch
        if not ids.is_cuda:
            return (ids.detach().clone(), None)
        buf = torch.empty(ids.shape, dtype=ids.dtype, device="cpu", pin_memory=True)
        buf.copy_(ids, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return (buf, ev)

    def copy_ready(self, handle: Any) -> bool:
        return handle[1] is None or bool(handle[1].query())

    def copy_result(self, handle: Any) -> Any:
        return handle[0].numpy()


@dataclass
class _Layer:
    """Per-layer state (a layer is its w1 weights' storage)."""

    experts: int
    routing_class: str
    calls: int = 0
    pending: deque[Any] = field(default_factory=deque)
    shapes: dict[int, MoEShape] = field(default_factory=dict)


@dataclass
class _Sample:
    key: Hashable
    index: int
    start: Any
    end: Any


def _flaggems_choice(shape: MoEShape) -> KernelConfig | None:
    """FlagGems' own config for ``shape`` (None where FlagGems cannot be asked here)."""
    try:
        from mxdb.kernels.layer import flaggems_kernel_config

        config: KernelConfig = flaggems_kernel_config(shape)
        return config
    except Exception:  # no FlagGems, no GPU: healing then has no safe candidate to add
        return None


def _kernels_pipeline(w1: Any, w2: Any, topk: int, config: KernelConfig | None) -> Runner:
    """mxdb's lean layer with the exact config (both GEMMs and the alignment), or with
    FlagGems' own choice per token count when ``config`` is None."""
    import torch

    from mxdb.kernels.layer import MoELayer

    layer = MoELayer(w1, w2, topk, lambda _m: config)

    def run(x: Any, tw: Any, ids: Any, inplace: bool) -> Any:
        out = x if inplace else torch.empty_like(x)
        return layer(x, tw, ids, out=out)

    return run


class Hook:
    """One installation of the hook (see the module docstring)."""

    def __init__(
        self,
        dispatcher: Any,
        *,
        monitor_every: int = 0,
        healing: HealingOptions | None = None,
        split: str = "pipeline",
        clock: Any = None,
        pipeline_factory: PipelineFactory | None = None,
        max_pipelines: int = 1024,
        lean: bool = True,
        lean_max_tokens: int = 256,
        safe_config: Callable[[MoEShape], KernelConfig | None] | None = None,
    ) -> None:
        if monitor_every < 0:
            raise UsageError(f"monitor_every must be >= 0 (0 disables), got {monitor_every}")
        if lean_max_tokens < 0:
            raise UsageError(f"lean_max_tokens must be >= 0, got {lean_max_tokens}")
        if split not in SPLIT_MODES:
            raise UsageError(f"split mode {split!r} unknown; use {', '.join(SPLIT_MODES)}")
        self.dispatcher = dispatcher
        self.monitor_every = monitor_every
        self.split = split
        self.clock = clock
        self.pipeline_factory = pipeline_factory or _kernels_pipeline
        self.max_pipelines = max_pipelines
        self.lean = lean
        self.lean_max_tokens = lean_max_tokens
        #: FlagGems' own config for a shape: healing's last candidate (the safe fallback)
        self.safe_config = safe_config or _flaggems_choice
        #: why the lean layer could not be built, per (w1, w2, config) key
        self.lean_errors: dict[tuple[Any, ...], str] = {}
        self.healer = Healer(healing, on_change=self._on_heal) if healing is not None else None
        self._sample_every = healing.sample_every if healing is not None else 0
        self._key_calls: dict[Hashable, int] = {}
        self._samples: deque[_Sample] = deque()
        self._layers: dict[Any, _Layer] = {}
        self._pipelines: dict[tuple[Any, ...], Runner] = {}
        self._plans: dict[int, tuple[KernelConfig, bool, dict[str, int]]] = {}
        self._tls = threading.local()
        self._lock = threading.Lock()
        self._patched: list[tuple[Any, str, Any]] = []
        self._capturing: Callable[[], bool] = _never
        self.log_filter = MissingTableFilter(lambda: bool(getattr(self._tls, "quiet", False)))
        self._filtered: list[logging.Logger] = []
        self.orig_impl: Any = None
        self.orig_config: Any = None
        self._binder: inspect.Signature | None = None
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "calls",
                "dispatched",
                "fallback",
                "unsupported",
                "split_pipeline",
                "split_gemm1",
                "split_fallback",
                "monitor_copies",
                "class_updates",
                "healing_samples",
                "healing_probes",
                "lean",
                "lean_fallback",
                "lean_unavailable",
                "capture_deferred",
            ),
            0,
        )

    # -- patching ------------------------------------------------------------------------

    def patch(self) -> None:
        import importlib
        import sys

        mod = importlib.import_module(MODULE)
        self.orig_impl = getattr(mod, IMPL)
        self.orig_config = getattr(mod, CONFIG_FN)
        try:
            self._binder = inspect.signature(self.orig_impl)
        except (TypeError, ValueError):
            self._binder = None
        if self.clock is None:
            self.clock = _default_clock()
        self._capturing = getattr(self.clock, "capturing", None) or _never
        for logger in _flaggems_loggers(mod):
            logger.addFilter(self.log_filter)
            self._filtered.append(logger)
        impl, config_fn = self._make_impl(), self._make_config_fn()
        replacements = {id(self.orig_impl): impl, id(self.orig_config): config_fn}
        originals = {id(self.orig_impl): self.orig_impl, id(self.orig_config): self.orig_config}
        for name, module in list(sys.modules.items()):
            if module is None or not (name == "flag_gems" or name.startswith("flag_gems.")):
                continue
            for attr in (IMPL, CONFIG_FN):
                value = getattr(module, attr, None)
                if value is not None and originals.get(id(value)) is value:
                    self._patched.append((module, attr, value))
                    setattr(module, attr, replacements[id(value)])

    def unpatch(self) -> None:
        for module, attr, value in reversed(self._patched):
            setattr(module, attr, value)
        self._patched.clear()
        for logger in self._filtered:
            logger.removeFilter(self.log_filter)
        self._filtered.clear()

    # -- the wrapped functions ------------------------------------------------------------

    def _make_config_fn(self) -> Callable[..., Any]:
        orig = self.orig_config
        tls = self._tls

        def try_get_optimal_moe_config(*args: Any, **kwargs: Any) -> Any:
            cfg = getattr(tls, "config", None)
            if cfg is not None:
                return dict(cfg)
            return orig(*args, **kwargs)

        try_get_optimal_moe_config.__wrapped__ = orig  # type: ignore[attr-defined]
        return try_get_optimal_moe_config

    def _make_impl(self) -> Callable[..., Any]:
        orig = self.orig_impl
        hook = self

        def fused_experts_impl(*args: Any, **kwargs: Any) -> Any:
            return hook.call(args, kwargs)

        fused_experts_impl.__wrapped__ = orig  # type: ignore[attr-defined]
        fused_experts_impl.__doc__ = orig.__doc__
        return fused_experts_impl

    def _params(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """The call's arguments by name, or None when the call is not one mxdb dispatches."""
        if len(args) >= 5 and len(args) <= 6:
            params = dict(kwargs)
            params["hidden_states"], params["w1"], params["w2"] = args[0], args[1], args[2]
            params["topk_weights"], params["topk_ids"] = args[3], args[4]
            if len(args) == 6:
                params["inplace"] = args[5]
        elif self._binder is not None:
            try:
                params = dict(self._binder.bind(*args, **kwargs).arguments)
            except TypeError:
                return None
        else:
            return None
        for flag in _UNSUPPORTED_FLAGS:
            v = params.get(flag)
            # Never take the truth value of a tensor (it would synchronize, or raise).
            if v is None or v is False or (isinstance(v, (int, str)) and not v):
                continue
            return None
        if params.get("activation", "silu") != "silu":
            return None
        return params

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One fused_experts_impl call through the hook."""
        c = self.counters
        c["calls"] += 1
        params = self._params(args, kwargs)
        if params is None:
            c["unsupported"] += 1
            return self.orig_impl(*args, **kwargs)
        hs, w1, ids = params["hidden_states"], params["w1"], params["topk_ids"]
        try:
            layer, shape = self._layer_shape(hs, w1, ids, params.get("global_num_experts", -1))
        except MxdbError:
            c["unsupported"] += 1
            return self.orig_impl(*args, **kwargs)
        layer.calls += 1
        if self.monitor_every:
            copy = layer.calls % self.monitor_every == 0
            if (copy or layer.pending) and self._capturing():
                # no event query, record or copy while the stream captures a graph
                c["capture_deferred"] += 1
            else:
                if layer.pending:
                    self._poll_monitor(layer)
                if copy:
                    layer.pending.append(self.clock.start_copy(ids))
                    c["monitor_copies"] += 1
        rc = layer.routing_class
        decision: Decision = self.dispatcher.dispatch(shape, rc)
        if decision.config is None:
            c["fallback"] += 1
            if self._lean_ok(hs):
                done, out = self._lean(params, None)
                if done:
                    c["lean_fallback"] += 1
                    return out
            return self.orig_impl(*args, **kwargs)
        if self._sample_every:
            key = (shape, rc)
            n = self._key_calls.get(key, 0) + 1
            self._key_calls[key] = n
            if n % self._sample_every == 0:
                if not self._capturing():
                    return self._sampled(key, decision, params, args, kwargs)
                c["capture_deferred"] += 1
        return self._run(decision.config, params, args, kwargs)

    def _lean_ok(self, hs: Any) -> bool:
        """Whether this call may run through the lean layer (see the module docstring)."""
        return (
            self.lean
            and getattr(hs, "is_cuda", False) is True
            and int(hs.shape[0]) <= self.lean_max_tokens
        )

    def _lean(self, params: dict[str, Any], config: KernelConfig | None) -> tuple[bool, Any]:
        """Run the call through the lean layer: (True, output), or (False, None) when the
        layer cannot be built or its first call fails (kept in ``lean_errors``; the caller
        then takes FlagGems' path, and this layer is not tried again)."""
        run = self._pipeline(params, config, lenient=True)
        if run is None:
            return False, None
        try:
            return True, self._call_runner(run, params)
        except Exception as exc:
            if self._capturing():  # a failed capture is the caller's to handle
                raise
            key = self._pipeline_key(params, config)
            with self._lock:
                self._pipelines.pop(key, None)
                self.lean_errors[key] = f"{type(exc).__name__}: {exc}"[:500]
            self.counters["lean_unavailable"] += 1
            return False, None

    def _call_runner(self, run: Runner, params: dict[str, Any]) -> Any:
        tls = self._tls
        tls.quiet = True
        try:
            return run(
                params["hidden_states"],
                params["topk_weights"],
                params["topk_ids"],
                bool(params.get("inplace", False)),
            )
        finally:
            tls.quiet = False

    def _layer_shape(self, hs: Any, w1: Any, ids: Any, global_experts: Any) -> tuple[_Layer, Any]:
        ptr = getattr(w1, "data_ptr", None)
        lkey = ptr() if callable(ptr) else id(w1)
        layer = self._layers.get(lkey)
        e, n2, h = (int(v) for v in w1.shape)
        if layer is None or layer.experts != e:
            if global_experts not in (-1, None, e):
                raise UsageError("an expert-parallel call (global_num_experts != E)")
            layer = _Layer(experts=e, routing_class=self.dispatcher.options.default_routing_class)
            self._layers[lkey] = layer
        m = int(hs.shape[0])
        shape = layer.shapes.get(m)
        if shape is None:
            shape = MoEShape(e, h, n2 // 2, int(ids.shape[1]), m, canonical_dtype(hs.dtype))
            if len(layer.shapes) < 4096:
                layer.shapes[m] = shape
        return layer, shape

    def _run(
        self,
        config: KernelConfig,
        params: dict[str, Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        c = self.counters
        plan = self._plans.get(id(config))
        if plan is None or plan[0] is not config:
            # Once per config object (the dispatcher shares them): equality and hashing of
            # pydantic models cost microseconds, too much for every call.
            g1 = config.gemm1
            fits = config.single
            plan = (config, fits, g1.to_triton())
            self._plans[id(config)] = plan
        _, fits, triton = plan
        if self._lean_ok(params["hidden_states"]):
            done, out = self._lean(params, config)
            if done:
                c["dispatched"] += 1
                c["lean"] += 1
                return out
        if not fits:
            if self.split == "pipeline":
                c["split_pipeline"] += 1
                run = self._pipeline(params, config)
                assert run is not None
                return self._call_runner(run, params)
            if self.split == "fallback":
                c["split_fallback"] += 1
                return self.orig_impl(*args, **kwargs)
            c["split_gemm1"] += 1
        c["dispatched"] += 1
        tls = self._tls
        tls.config = triton
        tls.quiet = True
        try:
            return self.orig_impl(*args, **kwargs)
        finally:
            tls.config = None
            tls.quiet = False

    @staticmethod
    def _pipeline_key(params: dict[str, Any], config: KernelConfig | None) -> tuple[Any, ...]:
        w1, w2 = params["w1"], params["w2"]
        ptr1, ptr2 = getattr(w1, "data_ptr", None), getattr(w2, "data_ptr", None)
        return (
            ptr1() if callable(ptr1) else id(w1),
            ptr2() if callable(ptr2) else id(w2),
            config.hash if config is not None else "flaggems",
        )

    def _pipeline(
        self, params: dict[str, Any], config: KernelConfig | None, *, lenient: bool = False
    ) -> Runner | None:
        """mxdb's layer for (w1, w2, config) (None: FlagGems' choice), built once.

        ``lenient``: a layer that cannot be built gives None (and is not tried again) instead
        of raising; the caller then takes FlagGems' path.
        """
        w1, w2 = params["w1"], params["w2"]
        key = self._pipeline_key(params, config)
        run = self._pipelines.get(key)
        if run is None:
            if lenient and key in self.lean_errors:
                return None
            with self._lock:
                run = self._pipelines.get(key)
                if run is None:
                    topk = int(params["topk_ids"].shape[1])
                    try:
                        run = self.pipeline_factory(w1, w2, topk, config)
                    except Exception as exc:
                        if not lenient:
                            raise
                        self.lean_errors[key] = f"{type(exc).__name__}: {exc}"[:500]
                        self.counters["lean_unavailable"] += 1
                        return None
                    if len(self._pipelines) >= self.max_pipelines:
                        self._pipelines.pop(next(iter(self._pipelines)))
                    self._pipelines[key] = run
        return run

    # -- routing monitor --------------------------------------------------------------------

    def _poll_monitor(self, layer: _Layer) -> None:
        clock = self.clock
        while layer.pending:
            handle = layer.pending[0]
            if not clock.copy_ready(handle):
                return
            try:
                layer.pending.popleft()
            except IndexError:  # another thread took it
                return
            self._classify(layer, clock.copy_result(handle))

    def _classify(self, layer: _Layer, ids: Any) -> None:
        import numpy as np

        from mxdb.routing import features

        try:
            cls = features(np.asarray(ids, dtype=np.int64), layer.experts).routing_class
        except MxdbError:  # padded or invalid ids: keep the current class
            return
        if cls != layer.routing_class:
            layer.routing_class = cls
            self.counters["class_updates"] += 1

    # -- healing ----------------------------------------------------------------------------

    def _sampled(
        self,
        key: Hashable,
        decision: Decision,
        params: dict[str, Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        healer = self.healer
        assert healer is not None
        self._drain_samples()
        if not healer.tracked(key):
            self._track(key, decision)
        index, planned = healer.plan(key)
        c = self.counters
        c["healing_samples"] += 1
        if index != healer.active(key):
            c["healing_probes"] += 1
        assert planned.config is not None
        clock = self.clock
        start = clock.mark()
        out = self._run(planned.config, params, args, kwargs)
        self._samples.append(_Sample(key, index, start, clock.mark()))
        return out

    def _drain_samples(self) -> None:
        healer, clock = self.healer, self.clock
        assert healer is not None
        while self._samples:
            s = self._samples[0]
            if not clock.ready(s.end):
                return
            try:
                self._samples.popleft()
            except IndexError:
                return
            healer.record(s.key, s.index, clock.elapsed_us(s.start, s.end))

    def _track(self, key: Hashable, decision: Decision) -> None:
        assert self.healer is not None
        shape, rc = cast("tuple[Any, Any]", key)
        try:
            cands = list(self.dispatcher.alternatives(shape, rc) or [decision])
        except (AttributeError, MxdbError):
            cands = [decision]
        # FlagGems' own choice is always the last candidate: when every config the store
        # offers has degraded, healing falls back to it before giving up on the key.
        try:
            safe = self.safe_config(shape)
        except Exception:  # a caller's safe_config that fails: no safe candidate, no crash
            safe = None
        if safe is not None and all(getattr(d.config, "hash", None) != safe.hash for d in cands):
            cands.append(
                Decision(config=safe, level=FALLBACK, confidence=0.0, reason="healing_fallback")
            )
        recorded: list[float | None] = []
        store = getattr(self.dispatcher, "store", None)
        for d in cands:
            median = None
            if store is not None and d.entry_id is not None:
                try:
                    median = store.get_entry(d.entry_id).median_us
                except MxdbError:
                    median = None
            recorded.append(median)
        self.healer.track(key, cands, recorded)

    def _on_heal(self, key: Hashable, decision: Decision, is_original: bool) -> None:
        shape, rc = cast("tuple[Any, Any]", key)
        self.dispatcher.set_override(shape, rc, None if is_original else decision)

    # -- inspection ---------------------------------------------------------------------------

    def routing_classes(self) -> dict[Any, str]:
        """The routing class each layer (keyed by its w1 storage) currently dispatches with."""
        return {k: v.routing_class for k, v in list(self._layers.items())}

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counters)
        out["layers"] = len(self._layers)
        out["routing_classes"] = sorted({v.routing_class for v in list(self._layers.values())})
        if self.healer is not None:
            out["transitions"] = [t.to_dict() for t in list(self.healer.transitions)]
        return out


def _never() -> bool:
    return False


def _default_clock() -> Any:
    try:
        import torch
    except ImportError:
        return HostClock()
    if torch.cuda.is_available():
        return CudaClock()
    return HostClock()


_installed: Hook | None = None
_install_lock = threading.Lock()


def install(
    dispatcher: Any = None,
    *,
    monitor_every: int = 1024,
    healing: HealingOptions | None = None,
    split: str = "pipeline",
    clock: Any = None,
    pipeline_factory: PipelineFactory | None = None,
    lean: bool = True,
    lean_max_tokens: int = 256,
    safe_config: Callable[[MoEShape], KernelConfig | None] | None = None,
) -> Hook:
    """Make FlagGems' fused-MoE path take its configs from mxdb; returns the installed hook.

    ``dispatcher`` defaults to the process-wide one (``mxdb.configure`` or the default store).
    ``monitor_every``: sample each layer's top-k ids every N calls to keep its routing class
    current (0 disables).  ``healing``: time a sample of calls and switch away from degraded
    configs (None disables).  ``split``: what to do with configs FlagGems cannot express
    (``pipeline``, ``gemm1`` or ``fallback``; see the module docstring).  ``lean``: run every
    call mxdb can run on CUDA tensors with at most ``lean_max_tokens`` tokens through mxdb's
    lean layer (False keeps FlagGems' own path).  ``safe_config``: FlagGems' own config for a
    shape, healing's last candidate after the store's alternatives (default: asked of
    FlagGems; None where it cannot be asked).  Installing again replaces the previous
    installation.
    """
    if dispatcher is None:
        from mxdb.dispatcher import default_dispatcher

        dispatcher = default_dispatcher()
    hook = Hook(
        dispatcher,
        monitor_every=monitor_every,
        healing=healing,
        split=split,
        clock=clock,
        pipeline_factory=pipeline_factory,
        lean=lean,
        lean_max_tokens=lean_max_tokens,
        safe_config=safe_config,
    )
    return install_hook(hook)


def install_hook(hook: Hook) -> Hook:
    """Install an existing hook object (replacing the installed one), keeping its state.

    A hook that was installed before and replaced keeps its call counts, routing classes,
    healing state and built layers; installing it again continues from them.  Benchmarks use
    this to alternate between hooks of different options without starting each one anew.
    """
    global _installed
    with _install_lock:
        if _installed is hook:
            return hook
        if _installed is not None:
            _installed.unpatch()
            _installed = None
        try:
            hook.patch()
        except ImportError as exc:
            raise UsageError(
                f"mxdb.install() needs FlagGems ({MODULE}) importable; importing it failed: {exc}; "
                "install it with `pip install mxdb[gpu]`"
            ) from None
        _installed = hook
    return hook


def uninstall() -> bool:
    """Restore FlagGems' original functions; False when nothing was installed."""
    global _installed
    with _install_lock:
        hook, _installed = _installed, None
        if hook is None:
            return False
        hook.unpatch()
        return True


def installed() -> Hook | None:
    """The installed hook, or None."""
    return _installed
