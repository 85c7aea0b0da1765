"""Recorded launches for the fused decode ops: Triton's JIT once per key, its launcher after.

A decode op's kernel is tiny (a few microseconds on the GPU); launching it through Triton's
Python path (argument binding, specialization, cache key, launch metadata, launch hooks) and
through a wrapper that builds temporaries costs far more host time than the kernel.  This module
does what :class:`mxdb.kernels.layer.MoELayer` does for the MoE layer: the first call at a key
goes through Triton's normal JIT launch while the launch is recorded at Triton's launcher; every
later call writes its tensors' data pointers and its scalars into a prebuilt argument list and
calls the compiled launcher directly.

Two cache levels, so that a key changing every decode step (the attention span of
``masked_softmax``) never recompiles nor re-enters Triton's JIT path:

* **exact key** (per op: shapes, strides, dtypes, device, pointer alignment): a ready
  :class:`Replay` (or :class:`JitCall`) plus the output dtype/shape, built once; a call is the
  key, one dict lookup, ``torch.empty`` for the outputs and the replay.
* **specialization key** (:class:`KernelLauncher`: device, constexprs, Triton's specialization
  class of every runtime argument, see :func:`spec_class`): one :class:`Template` recorded from
  one JIT launch.  A new exact key with a known specialization key builds its replay from the
  template without launching through Triton.

Recording (:func:`record`, also the recorder of :func:`mxdb.kernels.layer.record_plan`: one Triton
launch recorder for the package) hooks ``launcher_cls.__call__`` for the duration of one JIT launch, and
the launcher's ``launch`` attribute inside it, so it sees both the launcher call (stable across
Triton 3.x: grid, stream, function, packed metadata, launch metadata, two hooks, kernel
arguments) and the compiled launch function's own argument layout (which differs between Triton
versions: kernel arguments appended flat, or as one tuple).  The replay calls the compiled launch
function with that exact layout (mode ``recorded``); where the launch needs per-launch scratch
memory or its layout is not recognized it replays the launcher call instead (``recorded-call``);
where nothing could be recorded (Triton's interpreter, no active driver, unknown internals) the
key keeps Triton's normal launch (``jit``).  Replays pass no launch metadata and no launch hooks
(as MoELayer's plans do): profilers hooked into Triton do not see them.

The recorder is free of torch and triton (tested with fake launchers,
``tests/test_decode_launch.py``); :class:`DecodeOps`, the five ops over injected Triton kernels,
imports torch when built.  ``mxdb.kernels.decode_ops`` builds the default instance.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

#: Replays of Triton's compiled launch function (the fast path).
RECORDED = "recorded"
#: Replays of the launcher object's call (it allocates per-launch scratch, or unknown layout).
RECORDED_CALL = "recorded-call"
#: Triton's normal launch: recording refused, failed or turned off.
JIT = "jit"
MODES = (RECORDED, RECORDED_CALL, JIT)

#: Exact-key entries per op before the op's table is cleared (a bound on odd callers' keys).
MAX_ENTRIES = 4096

#: Positions in a launcher call: grid x/y/z, stream, function, packed metadata, launch metadata,
#: enter hook, exit hook; kernel arguments follow.
_CALL_HEAD = 9


class RecordRefused(RuntimeError):
    """The launch could not be recorded: the key keeps Triton's normal launch."""


def _is_ptr(v: Any) -> bool:
    return hasattr(v, "data_ptr") and not isinstance(v, (int, float))


def spec_class(v: Any) -> Hashable:
    """What Triton specializes a runtime kernel argument on (a finer class is always safe).

    Integers: equal to 1 (a compile-time constant), 32/64-bit, divisible by 16 (and by 8, which
    older Triton versions specialized on); tensors: dtype and 16-byte alignment of the data
    pointer; floats (fp32) and bools (u1) by type only.
    """
    if isinstance(v, bool):
        return "u1"
    if isinstance(v, int):
        if v == 1:
            return 1
        kind = "i32" if -(2**31) <= v < 2**31 else "i64" if -(2**63) <= v < 2**63 else "u64"
        return (kind, v % 16 == 0, v % 8 == 0)
    if isinstance(v, float):
        return "fp32"
    if v is None:
        return None
    if _is_ptr(v):
        return (str(v.dtype), v.data_ptr() % 16 == 0)
    raise RecordRefused(f"no specialization class for a {type(v).__name__} argument")


# -- replays ------------------------------------------------------------------------------------


class Replay:
    """One recorded launch with its argument list built once; ``replay(vals)`` per call.

    ``ptr_binds``: (position in ``kargs``, index in ``vals``) of the pointer arguments (their
    ``data_ptr()`` is written); ``val_binds``: the same for scalars (written as given).  With a
    flat layout ``kargs`` is ``args`` itself; with a nested one (the kernel arguments as one
    tuple at ``args[nested]``) the tuple is rebuilt from ``kargs`` per call.
    """

    __slots__ = ("args", "fn", "kargs", "mode", "nested", "ptr_binds", "stream_fn", "val_binds")

    def __init__(
        self,
        fn: Callable[..., Any],
        args: list[Any],
        kargs: list[Any],
        nested: int,
        ptr_binds: tuple[tuple[int, int], ...],
        val_binds: tuple[tuple[int, int], ...],
        stream_fn: Callable[[], Any],
        mode: str,
    ) -> None:
        self.fn = fn
        self.args = args
        self.kargs = kargs
        self.nested = nested
        self.ptr_binds = ptr_binds
        self.val_binds = val_binds
        self.stream_fn = stream_fn
        self.mode = mode

    def __call__(self, vals: Sequence[Any]) -> None:
        k = self.kargs
        for pos, i in self.ptr_binds:
            k[pos] = vals[i].data_ptr()
        for pos, i in self.val_binds:
            k[pos] = vals[i]
        args = self.args
        if self.nested >= 0:
            args[self.nested] = tuple(k)
        args[3] = self.stream_fn()
        self.fn(*args)


class JitCall:
    """Triton's normal launch of one exact key: ``kernel[grid](*args, **kw)`` with the call's
    tensors written into their slots (the path used when recording is refused or off)."""

    __slots__ = ("args", "binds", "grid", "jit", "kw", "mode")

    def __init__(
        self,
        jit: Any,
        grid: tuple[int, ...],
        args: list[Any],
        kw: dict[str, Any],
        binds: tuple[tuple[int, int], ...],
    ) -> None:
        self.jit = jit
        self.grid = grid
        self.args = [None if _is_ptr(a) else a for a in args]  # keep no tensor alive
        self.kw = kw
        self.binds = binds
        self.mode = JIT

    def __call__(self, vals: Sequence[Any]) -> None:
        args = list(self.args)
        for pos, i in self.binds:
            args[pos] = vals[i]
        self.jit[self.grid](*args, **self.kw)


def _noop(vals: Sequence[Any]) -> None:
    """The launch of an empty input (zero rows): nothing."""


# -- recording ----------------------------------------------------------------------------------


class Template:
    """The launch layout of one compiled kernel, from one recorded launch.

    ``args``: the full argument list of ``fn`` (pointers blanked, hooks and launch metadata
    ``None``); the kernel arguments sit flat at ``args[koff:]`` or, when ``nested >= 0``, as
    one tuple ``args[nested]`` (kept as the list ``kargs``).  ``owner`` keeps what the JIT launch
    returned (Triton's compiled kernel, which owns the loaded module) alive.
    """

    __slots__ = ("args", "fn", "kargs", "koff", "mode", "nested", "owner")

    def __init__(
        self,
        fn: Callable[..., Any],
        args: list[Any],
        mode: str,
        *,
        koff: int = -1,
        nested: int = -1,
        kargs: Sequence[Any] = (),
        owner: Any = None,
    ) -> None:
        self.fn = fn
        self.args = args
        self.mode = mode
        self.koff = koff
        self.nested = nested
        self.kargs = [None if _is_ptr(a) else a for a in kargs]
        self.owner = owner
        if nested >= 0:
            args[nested] = None  # rebuilt from kargs per call
        else:
            for j in range(koff, len(args)):
                if _is_ptr(args[j]):
                    args[j] = None

    def replay(
        self,
        grid: tuple[int, int, int],
        rt_args: Sequence[Any],
        ptr_binds: tuple[tuple[int, int], ...],
        val_binds: tuple[tuple[int, int], ...],
        stream_fn: Callable[[], Any],
    ) -> Replay:
        """A :class:`Replay` for one exact key: this key's grid and integer arguments written in,
        its pointers and scalars bound to the call's values."""
        args = list(self.args)
        args[0:3] = grid
        if self.nested >= 0:
            kargs = list(self.kargs)
            off = 0
        else:
            kargs = args
            off = self.koff
        bound = {p for p, _ in ptr_binds} | {p for p, _ in val_binds}
        for j, a in enumerate(rt_args):
            if j not in bound:
                kargs[off + j] = a
        return Replay(
            self.fn,
            args,
            kargs,
            self.nested,
            tuple((off + p, i) for p, i in ptr_binds),
            tuple((off + p, i) for p, i in val_binds),
            stream_fn,
            self.mode,
        )


#: One launcher call seen while recording: (launcher, its call arguments, the launch function
#: calls made inside it as (function, arguments)).
Seen = tuple[Any, tuple[Any, ...], list[tuple[Callable[..., Any], tuple[Any, ...]]]]


def record(launcher_cls: type, launch: Callable[[], Any]) -> tuple[list[Seen], Any]:
    """Run ``launch()`` (one JIT launch) with ``launcher_cls.__call__`` and each launcher's
    ``launch`` attribute spied on; returns what was seen and what ``launch()`` returned.

    Both hooks are removed before this returns, whatever happens; the launch itself runs
    unchanged (each spy calls through).
    """
    seen: list[Seen] = []
    had = "__call__" in launcher_cls.__dict__
    orig = launcher_cls.__call__

    def spy(self: Any, *a: Any) -> Any:
        inner: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        own = getattr(self, "__dict__", {})
        real = own.get("launch")
        if real is not None:

            def launch_spy(*la: Any) -> Any:
                inner.append((real, la))
                return real(*la)

            own["launch"] = launch_spy
        try:
            return orig(self, *a)
        finally:
            if real is not None:
                own["launch"] = real
            seen.append((self, a, inner))

    launcher_cls.__call__ = spy  # type: ignore[method-assign]
    try:
        result = launch()
    finally:
        if had:
            launcher_cls.__call__ = orig  # type: ignore[method-assign]
        else:
            del launcher_cls.__call__
    return seen, result


def _same(a: Sequence[Any], b: Sequence[Any]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def template_from(seen: list[Seen], rt_args: Sequence[Any], owner: Any = None) -> Template:
    """The :class:`Template` of one recorded launch, or :class:`RecordRefused`.

    Checks that exactly one launcher call was made, that its kernel arguments start with
    ``rt_args`` (the same objects), and, for the fast mode, that the compiled launch function's
    arguments hold the grid, stream, function and the kernel arguments where expected.
    """
    if len(seen) != 1:
        raise RecordRefused(f"the JIT launch made {len(seen)} launcher calls (expected 1)")
    launcher, a, inner = seen[0]
    n = len(rt_args)
    if len(a) < _CALL_HEAD + n or not _same(a[_CALL_HEAD : _CALL_HEAD + n], rt_args):
        raise RecordRefused("unknown launcher call layout (kernel arguments not found)")
    kargs = a[_CALL_HEAD:]
    scratch = (
        getattr(launcher, "global_scratch_size", 0)
        or getattr(launcher, "profile_scratch_size", 0)
        or getattr(launcher, "gsan_enabled", False)
    )
    if not scratch and len(inner) == 1:
        t = _fast_template(inner[0], a, kargs, owner)
        if t is not None:
            return t
    call_args = [*a[:6], None, None, None, *kargs]
    return Template(launcher, call_args, RECORDED_CALL, koff=_CALL_HEAD, owner=owner)


def _fast_template(
    inner: tuple[Callable[..., Any], tuple[Any, ...]],
    a: tuple[Any, ...],
    kargs: tuple[Any, ...],
    owner: Any,
) -> Template | None:
    fn, la = inner
    if len(la) < 5 or tuple(la[:3]) != tuple(a[:3]) or la[3] != a[3] or la[4] is not a[4]:
        return None
    args = list(la)
    for obj in a[6:9]:  # launch metadata and hooks: the replay passes None
        if obj is None:
            continue
        hits = [p for p, v in enumerate(args) if v is obj]
        if not hits:
            return None
        for p in hits:
            args[p] = None
    k = len(kargs)
    for p, v in enumerate(args):
        if isinstance(v, tuple) and _same(v, kargs):
            return Template(fn, args, RECORDED, nested=p, kargs=kargs, owner=owner)
    if k and len(args) >= 5 + k and _same(args[len(args) - k :], kargs):
        return Template(fn, args, RECORDED, koff=len(args) - k, owner=owner)
    return None


class KernelLauncher:
    """One Triton kernel's launches: a :class:`Template` per specialization key.

    ``jit`` is the kernel (``jit[grid](*args, **kw)``), ``launcher_cls()`` answers Triton's
    launcher class (``triton.runtime.driver.active.launcher_cls``; it may raise: the key then
    keeps the JIT launch), ``stream_for(device_index)`` a zero-argument function answering the
    device's current raw stream.  ``record=False`` keeps every key on the JIT launch.
    """

    def __init__(
        self,
        name: str,
        jit: Any,
        launcher_cls: Callable[[], type],
        stream_for: Callable[[int], Callable[[], Any]],
        *,
        record: bool = True,
    ) -> None:
        self.name = name
        self.jit = jit
        self.launcher_cls = launcher_cls
        self.stream_for = stream_for
        self.record = record
        #: specialization key -> its template, or None (Triton's normal launch)
        self.templates: dict[Hashable, Template | None] = {}
        #: specialization key -> why it was not recorded
        self.errors: dict[Hashable, str] = {}
        self._streams: dict[int, Callable[[], Any]] = {}

    def prepare(
        self,
        grid0: int,
        rt_args: Sequence[Any],
        kw: Mapping[str, Any],
        vals: Sequence[Any],
        device: int,
    ) -> tuple[Callable[[Sequence[Any]], None], bool]:
        """The launch of one exact key, and whether this call already launched it.

        ``rt_args``: the kernel's runtime arguments (positional, before its constexprs, which
        are in ``kw`` with the launch options); every pointer and float among them must be one
        of ``vals`` (the per-call values, found by identity).  A new specialization key is
        launched here, once, through Triton's JIT path while it is recorded.
        """
        ptr_binds, val_binds = _binds(rt_args, vals)
        key = (device, tuple(sorted(kw.items())), tuple(spec_class(a) for a in rt_args))
        grid = (grid0, 1, 1)
        launched = False
        if key not in self.templates:
            self.templates[key] = self._first(key, grid, rt_args, kw)
            launched = True
        t = self.templates[key]
        if t is None:
            kw_d = dict(kw)
            return JitCall(self.jit, (grid0,), list(rt_args), kw_d, ptr_binds + val_binds), launched
        stream_fn = self._streams.get(device)
        if stream_fn is None:
            stream_fn = self._streams[device] = self.stream_for(device)
        return t.replay(grid, rt_args, ptr_binds, val_binds, stream_fn), launched

    def _first(
        self,
        key: Hashable,
        grid: tuple[int, int, int],
        rt_args: Sequence[Any],
        kw: Mapping[str, Any],
    ) -> Template | None:
        def launch() -> Any:
            return self.jit[grid[:1]](*rt_args, **kw)

        if not self.record:
            launch()
            self.errors[key] = "recording is off"
            return None
        try:
            cls = self.launcher_cls()
        except Exception as exc:  # no active driver (the interpreter), unknown internals
            launch()
            self.errors[key] = f"no launcher class: {type(exc).__name__}: {exc}"
            return None
        seen, owner = record(cls, launch)  # errors of the launch itself propagate
        try:
            return template_from(seen, rt_args, owner)
        except RecordRefused as exc:
            self.errors[key] = str(exc)
            return None

    def modes(self) -> dict[str, int]:
        """Specialization keys per mode."""
        out = dict.fromkeys(MODES, 0)
        for t in self.templates.values():
            out[JIT if t is None else t.mode] += 1
        return out


def _binds(
    rt_args: Sequence[Any], vals: Sequence[Any]
) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
    ptrs: list[tuple[int, int]] = []
    scalars: list[tuple[int, int]] = []
    for j, a in enumerate(rt_args):
        if isinstance(a, (bool, int)) or a is None:
            continue
        i = next((i for i, v in enumerate(vals) if v is a), -1)
        if i < 0:
            raise ValueError(f"kernel argument {j} ({type(a).__name__}) is not a per-call value")
        (ptrs if _is_ptr(a) else scalars).append((j, i))
    return tuple(ptrs), tuple(scalars)


# -- the decode ops -----------------------------------------------------------------------------


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8


def _row_stride(t: Any) -> int | None:
    """The row stride of ``t`` seen as ``[rows, t.shape[-1]]`` without a copy, or None."""
    try:
        v = t.view(-1, t.shape[-1])
    except RuntimeError:
        return None
    return int(v.stride(0)) if v.stride(-1) == 1 else None


def _fixed(ts: Sequence[Any], fix: tuple[bool, ...]) -> list[Any]:
    return [t.contiguous() if f else t for t, f in zip(ts, fix, strict=True)]


class DecodeOps:
    """The five fused decode ops over Triton kernels, each launch recorded once per key.

    ``kernels``: ``{"rms_norm": ..., "rope": ..., "masked_softmax": ..., "swiglu": ...}`` (the
    JIT functions of :mod:`mxdb.kernels.decode_ops`, or fakes); ``launcher_cls`` and
    ``stream_for`` as in :class:`KernelLauncher`.  Results are those of the JIT launches (same
    kernels, same arguments); ``record=False`` keeps Triton's normal launch everywhere.
    """

    OPS = ("rms_norm", "add_rms_norm", "rope", "masked_softmax", "swiglu")

    def __init__(
        self,
        kernels: Mapping[str, Any],
        launcher_cls: Callable[[], type],
        stream_for: Callable[[int], Callable[[], Any]],
        *,
        record: bool = True,
        max_programs: int = 65535,
        max_width: int = 65536,
    ) -> None:
        import torch

        self._empty = torch.empty
        self._empty_strided = torch.empty_strided
        self._promote = torch.promote_types
        self.record = record
        self.max_programs = max_programs
        self.max_width = max_width
        self.launchers = {
            name: KernelLauncher(name, jit, launcher_cls, stream_for, record=record)
            for name, jit in kernels.items()
        }
        #: op -> exact key -> the op's entry (launch first)
        self.tables: dict[str, dict[Hashable, tuple[Any, ...]]] = {op: {} for op in self.OPS}
        self._rms = self.tables["rms_norm"]
        self._add = self.tables["add_rms_norm"]
        self._rope = self.tables["rope"]
        self._sm = self.tables["masked_softmax"]
        self._glu = self.tables["swiglu"]

    # -- bookkeeping

    def paths(self) -> dict[str, Any]:
        """Which launch path is in use: specialization keys per mode per kernel, exact-key
        entries per mode per op, why keys were not recorded, and one word (``recorded``,
        ``recorded-call``, ``jit``, ``mixed`` or ``none`` before any call)."""
        kernels = {name: kl.modes() for name, kl in self.launchers.items()}
        ops: dict[str, dict[str, int]] = {}
        for op, table in self.tables.items():
            counts = dict.fromkeys(MODES, 0)
            for entry in table.values():
                mode = getattr(entry[0], "mode", None)
                if mode is not None:
                    counts[mode] += 1
            ops[op] = counts
        total = {m: sum(k[m] for k in kernels.values()) for m in MODES}
        used = [m for m in MODES if total[m]]
        word = "none" if not used else used[0] if len(used) == 1 else "mixed"
        errors = sorted({e for kl in self.launchers.values() for e in kl.errors.values()})
        return {"path": word, "record": self.record, "kernels": kernels, "ops": ops,
                "errors": errors}  # fmt: skip

    def clear(self) -> None:
        """Forget every exact key (the recorded templates stay)."""
        for table in self.tables.values():
            table.clear()

    def _grid(self, rows: int) -> int:
        return max(1, min(rows, self.max_programs))

    def _block(self, n: int) -> int:
        if n > self.max_width:
            raise ValueError(
                f"row width {n} exceeds {self.max_width}; use the torch implementation"
            )
        return max(16, next_power_of_2(n))

    @staticmethod
    def _store(
        table: dict[Hashable, tuple[Any, ...]], key: Hashable, entry: tuple[Any, ...]
    ) -> None:
        if len(table) >= MAX_ENTRIES:
            table.clear()
        table[key] = entry

    # -- RMSNorm

    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        """``weight * rmsnorm(x)`` over the last dim; output dtype is ``weight * x``'s."""
        key = (x.shape, x.stride(), x.dtype, weight.stride(), weight.dtype, x.get_device(),
               x.data_ptr() & 15, weight.data_ptr() & 15)  # fmt: skip
        e = self._rms.get(key)
        if e is None:
            return self._rms_first(key, x, weight, float(eps))
        run, dtype, device, fix = e
        if fix:
            x, weight = _fixed((x, weight), fix)
        y = self._empty(key[0], dtype=dtype, device=device)
        run((x, weight, y, float(eps)))
        return y

    def _rms_first(self, key: Hashable, x: Any, weight: Any, eps: float) -> Any:
        n = x.shape[-1]
        fix = (_row_stride(x) is None, weight.stride(-1) != 1)
        x, weight = _fixed((x, weight), fix)
        dtype = self._promote(weight.dtype, x.dtype)
        y = self._empty(x.shape, dtype=dtype, device=x.device)
        rows = y.numel() // n if n else 0
        run: Callable[[Sequence[Any]], None] = _noop
        launched = False
        vals = (x, weight, y, eps)
        if rows:
            block = self._block(n)
            rt = [x, x, weight, y, y, rows, n, _row_stride(x), 0, n, 0, eps]
            kw = {"HAS_RES": False, "BLOCK": block, "num_warps": _warps(block)}
            run, launched = self.launchers["rms_norm"].prepare(
                self._grid(rows), rt, kw, vals, x.get_device()
            )
        self._store(self._rms, key, (run, dtype, x.device, fix if any(fix) else ()))
        if not launched:
            run(vals)
        return y

    def add_rms_norm(self, x: Any, residual: Any, weight: Any, eps: float) -> tuple[Any, Any]:
        """``h = residual + x`` (model dtype) and ``weight * rmsnorm(h)``: returns ``(normed, h)``."""
        key = (x.shape, x.stride(), x.dtype, residual.shape, residual.stride(), residual.dtype,
               weight.stride(), weight.dtype, x.get_device(), x.data_ptr() & 15,
               residual.data_ptr() & 15, weight.data_ptr() & 15)  # fmt: skip
        e = self._add.get(key)
        if e is None:
            return self._add_first(key, x, residual, weight, float(eps))
        run, ydt, hdt, device, fix = e
        if fix:
            x, residual, weight = _fixed((x, residual, weight), fix)
        shape = key[0]
        y = self._empty(shape, dtype=ydt, device=device)
        h = self._empty(shape, dtype=hdt, device=device)
        run((x, residual, weight, y, h, float(eps)))
        return y, h

    def _add_first(self, key: Hashable, x: Any, r: Any, weight: Any, eps: float) -> Any:
        n = x.shape[-1]
        fix = (_row_stride(x) is None, _row_stride(r) is None, weight.stride(-1) != 1)
        x, r, weight = _fixed((x, r, weight), fix)
        hdt = self._promote(r.dtype, x.dtype)
        ydt = self._promote(weight.dtype, hdt)
        y = self._empty(x.shape, dtype=ydt, device=x.device)
        h = self._empty(x.shape, dtype=hdt, device=x.device)
        rows = y.numel() // n if n else 0
        run: Callable[[Sequence[Any]], None] = _noop
        launched = False
        vals = (x, r, weight, y, h, eps)
        if rows:
            block = self._block(n)
            rt = [x, r, weight, y, h, rows, n, _row_stride(x), _row_stride(r), n, n, eps]
            kw = {"HAS_RES": True, "BLOCK": block, "num_warps": _warps(block)}
            run, launched = self.launchers["rms_norm"].prepare(
                self._grid(rows), rt, kw, vals, x.get_device()
            )
        self._store(self._add, key, (run, ydt, hdt, x.device, fix if any(fix) else ()))
        if not launched:
            run(vals)
        return y, h

    # -- RoPE

    def rope(self, q: Any, k: Any, cos: Any, sin: Any) -> tuple[Any, Any]:
        """Rotary embedding of ``q`` ``[B, Hq, S, D]`` and ``k`` ``[B, Hk, S, D]`` (any strides
        with a unit last stride); ``cos``/``sin`` ``[B, S, D]`` or ``[S, D]``, HF's form."""
        key = (q.shape, q.stride(), k.shape, k.stride(), cos.shape, cos.stride(), sin.shape,
               sin.stride(), q.dtype, k.dtype, cos.dtype, sin.dtype, q.get_device(),
               q.data_ptr() & 15, k.data_ptr() & 15, cos.data_ptr() & 15,
               sin.data_ptr() & 15)  # fmt: skip
        e = self._rope.get(key)
        if e is None:
            return self._rope_first(key, q, k, cos, sin)
        run, qs, qst, ks, kst, dtq, dtk, device, fix = e
        if fix:
            q, k, cos, sin = _fixed((q, k, cos, sin), fix)
        empty = self._empty_strided
        qo = empty(qs, qst, dtype=dtq, device=device)
        ko = empty(ks, kst, dtype=dtk, device=device)
        run((q, k, cos, sin, qo, ko))
        return qo, ko

    def _rope_first(self, key: Hashable, q: Any, k: Any, cos: Any, sin: Any) -> Any:
        import torch

        fix = tuple(t.stride(-1) != 1 for t in (q, k, cos, sin))
        q, k, cos, sin = _fixed((q, k, cos, sin), fix)
        bsz, hq, seq, dim = q.shape
        hk = k.shape[1]
        qo = torch.empty_like(q)
        ko = torch.empty_like(k)
        n_tok = bsz * seq
        run: Callable[[Sequence[Any]], None] = _noop
        launched = False
        vals = (q, k, cos, sin, qo, ko)
        if n_tok:
            half = dim // 2
            cb, cs = _bsd(cos, bsz)
            sb, ss = _bsd(sin, bsz)
            bhq = next_power_of_2(hq)
            bhk = next_power_of_2(hk)
            bd = max(16, next_power_of_2(half))
            rt = [
                q, k, cos, sin, qo, ko, n_tok, seq, hq, hk, half,
                q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
                cb, cs, sb, ss,
            ]  # fmt: skip
            kw = {"BLOCK_HQ": bhq, "BLOCK_HK": bhk, "BLOCK_D": bd, "num_warps": _warps(bhq * bd)}
            run, launched = self.launchers["rope"].prepare(
                self._grid(n_tok), rt, kw, vals, q.get_device()
            )
        entry = (run, qo.shape, qo.stride(), ko.shape, ko.stride(), qo.dtype, ko.dtype,
                 qo.device, fix if any(fix) else ())  # fmt: skip
        self._store(self._rope, key, entry)
        if not launched:
            run(vals)
        return qo, ko

    # -- masked softmax

    def masked_softmax(self, scores: Any, mask: Any, scale: float) -> Any:
        """``softmax(scores * scale + mask)`` in float32 over the last dim, cast to
        ``scores.dtype``; ``scores`` ``[B, H, Sq, Sk]``, ``mask`` broadcasting to it (its last
        dim may be longer: the first ``Sk`` columns are used)."""
        mk = None if mask is None else (mask.shape, mask.stride(), mask.dtype, mask.data_ptr() & 15)
        key = (scores.shape, scores.stride(), scores.dtype, scores.get_device(),
               scores.data_ptr() & 15, mk)  # fmt: skip
        e = self._sm.get(key)
        if e is None:
            return self._sm_first(key, scores, mask, float(scale))
        run, device, fix = e
        if fix:
            scores, mask = self._sm_fixed(scores, mask, fix)
        y = self._empty(key[0], dtype=key[2], device=device)
        run((scores, scores if mask is None else mask, y, float(scale)))
        return y

    @staticmethod
    def _sm_fixed(scores: Any, mask: Any, fix: tuple[bool, ...]) -> tuple[Any, Any]:
        if fix[0]:
            scores = scores.contiguous()
        if fix[1]:
            mask = mask[..., : scores.shape[-1]].contiguous()
        return scores, mask

    def _sm_first(self, key: Hashable, scores: Any, mask: Any, scale: float) -> Any:
        fix = (_row_stride(scores) is None, mask is not None and mask.stride(-1) != 1)
        scores, mask = self._sm_fixed(scores, mask, fix)
        bsz, heads, sq, sk = scores.shape
        y = self._empty(scores.shape, dtype=scores.dtype, device=scores.device)
        rows = bsz * heads * sq
        run: Callable[[Sequence[Any]], None] = _noop
        launched = False
        m = scores if mask is None else mask
        vals = (scores, m, y, scale)
        if rows and sk:
            block = self._block(sk)
            if mask is not None:
                me = mask[..., :sk].expand(bsz, heads, sq, sk)
                mb, mh, mq = me.stride(0), me.stride(1), me.stride(2)
            else:
                mb = mh = mq = 0
            rt = [scores, m, y, rows, sk, heads, sq, _row_stride(scores), sk, mb, mh, mq, scale]
            kw = {"HAS_MASK": mask is not None, "BLOCK": block, "num_warps": _warps(block)}
            run, launched = self.launchers["masked_softmax"].prepare(
                self._grid(rows), rt, kw, vals, scores.get_device()
            )
        self._store(self._sm, key, (run, scores.device, fix if any(fix) else ()))
        if not launched:
            run(vals)
        return y

    # -- SwiGLU

    def swiglu(self, gate: Any, up: Any) -> Any:
        """``silu(gate) * up``; ``gate`` and ``up`` may be halves (views) of one projection."""
        key = (gate.shape, gate.stride(), up.shape, up.stride(), gate.dtype, up.dtype,
               gate.get_device(), gate.data_ptr() & 15, up.data_ptr() & 15)  # fmt: skip
        e = self._glu.get(key)
        if e is None:
            return self._glu_first(key, gate, up)
        run, dtype, device, fix = e
        if fix:
            gate, up = _fixed((gate, up), fix)
        y = self._empty(key[0], dtype=dtype, device=device)
        run((gate, up, y))
        return y

    def _glu_first(self, key: Hashable, gate: Any, up: Any) -> Any:
        n = gate.shape[-1]
        fix = (_row_stride(gate) is None, _row_stride(up) is None)
        gate, up = _fixed((gate, up), fix)
        dtype = self._promote(gate.dtype, up.dtype)
        y = self._empty(gate.shape, dtype=dtype, device=gate.device)
        rows = y.numel() // n if n else 0
        run: Callable[[Sequence[Any]], None] = _noop
        launched = False
        vals = (gate, up, y)
        if rows:
            block = min(1024, max(16, next_power_of_2(n)))
            tiles = rows * -(-n // block)
            rt = [gate, up, y, rows, n, _row_stride(gate), _row_stride(up), n]
            kw = {"BLOCK": block, "num_warps": _warps(block)}
            run, launched = self.launchers["swiglu"].prepare(
                self._grid(tiles), rt, kw, vals, gate.get_device()
            )
        self._store(self._glu, key, (run, dtype, gate.device, fix if any(fix) else ()))
        if not launched:
            run(vals)
        return y


def _bsd(t: Any, batch: int) -> tuple[int, int]:
    """Batch and sequence strides of cos/sin ``[B or 1, S, D]`` (0 for a broadcast batch)."""
    if t.dim() == 2:
        return 0, t.stride(0)
    return (t.stride(0) if t.shape[0] == batch and batch > 1 else 0), t.stride(1)
