"""Recorded decode-op launches (mxdb.kernels.decode_launch) with fake Triton launchers: no GPU.

The fakes mimic Triton's launch path: a JIT function (``kernel[grid](*args, **kw)``) that picks a
compiled kernel per specialization and calls its launcher object (``launcher(gx, gy, gz, stream,
function, packed metadata, launch metadata, enter hook, exit hook, *kernel args)``), whose
``launch`` attribute is the compiled launch function, with Triton 3.9's argument layout (kernel
arguments as one tuple) or the older flat one.  Every launch is logged with its pointers as
integers; the tests compare the recorded path's launches with the JIT path's for the same inputs,
call after call, with fresh tensors each time (a stale pointer shows).

The recorder tests need nothing; the op tests need CPU torch (not triton).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
from mxdb.kernels.decode_launch import (
    JIT,
    RECORDED,
    RECORDED_CALL,
    DecodeOps,
    KernelLauncher,
    RecordRefused,
    record,
    spec_class,
    template_from,
)


def _ptr(a: Any) -> Any:
    return a.data_ptr() if hasattr(a, "data_ptr") else a


class World:
    """One fake Triton: launchers of one layout, a launch log, the current stream, a hook."""

    def __init__(self, layout: str = "nested", scratch: int = 0) -> None:
        self.layout = layout
        self.scratch = scratch
        self.log: list[tuple[Any, ...]] = []
        self.stream = 7
        self.hook: Callable[..., Any] | None = None
        self.hook_calls = 0
        self.jit_calls = 0
        self.scratch_ptrs = itertools.count(1000)
        world = self

        class Launcher:
            def __init__(self) -> None:
                self.global_scratch_size = world.scratch
                self.profile_scratch_size = 0
                self.launch = {"flat": world.c_launch_flat, "swapped": world.c_launch_swapped}.get(
                    layout, world.c_launch_nested
                )

            def __call__(
                self, gx: int, gy: int, gz: int, stream: int, fn: Any, packed: Any,
                meta: Any, enter: Any, exit_: Any, *args: Any,
            ) -> None:  # fmt: skip
                scratch = next(world.scratch_ptrs) if self.global_scratch_size else None
                if world.layout == "flat":
                    self.launch(gx, gy, gz, stream, fn, False, False, scratch, None, packed,
                                meta, enter, exit_, *args)  # fmt: skip
                elif world.layout == "swapped":  # an unknown layout: function before stream
                    self.launch(gx, gy, gz, fn, stream, packed, meta, enter, exit_, *args)
                else:
                    self.launch(gx, gy, gz, stream, fn, False, False, packed, meta, enter,
                                exit_, scratch, None, "annotations", "signature", args)  # fmt: skip

        self.Launcher = Launcher

    def _log(self, grid: tuple[int, ...], stream: int, fn: Any, enter: Any, meta: Any,
             scratch: Any, kargs: tuple[Any, ...]) -> None:  # fmt: skip
        if enter is not None:
            self.hook_calls += 1
            enter(meta)
        self.log.append((fn, grid, stream, scratch, tuple(_ptr(a) for a in kargs)))

    def c_launch_nested(self, gx: int, gy: int, gz: int, stream: int, fn: Any, coop: bool,
                        pdl: bool, packed: Any, meta: Any, enter: Any, exit_: Any, gs: Any,
                        ps: Any, ann: Any, sig: Any, kargs: tuple[Any, ...]) -> None:  # fmt: skip
        assert packed == "packed" and ann == "annotations" and sig == "signature"
        self._log((gx, gy, gz), stream, fn, enter, meta, gs, kargs)

    def c_launch_flat(self, gx: int, gy: int, gz: int, stream: int, fn: Any, coop: bool,
                      pdl: bool, gs: Any, ps: Any, packed: Any, meta: Any, enter: Any,
                      exit_: Any, *kargs: Any) -> None:  # fmt: skip
        assert packed == "packed"
        self._log((gx, gy, gz), stream, fn, enter, meta, gs, kargs)

    def c_launch_swapped(self, gx: int, gy: int, gz: int, fn: Any, stream: int, packed: Any,
                         meta: Any, enter: Any, exit_: Any, *kargs: Any) -> None:  # fmt: skip
        self._log((gx, gy, gz), stream, fn, enter, meta, None, kargs)

    def jit(self, name: str, launches: bool = True) -> FakeJit:
        return FakeJit(self, name, launches)

    def ops(self, **kw: Any) -> DecodeOps:
        kernels = {k: self.jit(k) for k in ("rms_norm", "rope", "masked_softmax", "swiglu")}
        return DecodeOps(kernels, lambda: self.Launcher, lambda dev: lambda: self.stream, **kw)


class FakeJit:
    """``kernel[grid](*args, **kw)``: one compiled kernel (launcher) per specialization."""

    def __init__(self, world: World, name: str, launches: bool) -> None:
        self.world, self.name, self.launches = world, name, launches
        self.compiled: dict[Any, tuple[Any, str]] = {}

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        return lambda *a, **kw: self.run(grid, a, kw)

    def run(self, grid: tuple[int, ...], args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        w = self.world
        w.jit_calls += 1
        consts = {k: v for k, v in kw.items() if k != "num_warps"}
        key = (tuple(spec_class(a) for a in args), tuple(sorted(kw.items())))
        if key not in self.compiled:
            self.compiled[key] = (w.Launcher(), f"{self.name}#{len(self.compiled)}")
        launcher, fn = self.compiled[key]
        if not self.launches:  # the interpreter: runs without any launcher
            w.log.append((fn, (*grid, 1, 1)[:3], None, None, tuple(map(_ptr, args))))
            return None
        meta = {"name": fn} if w.hook is not None else None
        launcher(grid[0], 1, 1, w.stream, fn, "packed", meta, w.hook, None, *args,
                 *consts.values())  # fmt: skip
        return ("compiled", fn)


# -- the recorder alone ------------------------------------------------------------------------


class P:
    """A pointer argument (a tensor stand-in)."""

    dtype = "fp16"

    def __init__(self, p: int) -> None:
        self.p = p

    def data_ptr(self) -> int:
        return self.p


@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_recorded_template_replays_the_launch_function_with_new_pointers(layout: str) -> None:
    w = World(layout)
    kl = KernelLauncher("k", w.jit("k"), lambda: w.Launcher, lambda dev: lambda: w.stream)
    x, y = P(4096), P(8192)
    rt = [x, y, 5, 64, 0.5]
    run, launched = kl.prepare(5, rt, {"BLOCK": 64, "num_warps": 1}, (x, y, 0.5), 0)
    assert launched and w.jit_calls == 1 and run.mode == RECORDED  # type: ignore[attr-defined]
    assert w.log[-1][1:] == ((5, 1, 1), 7, None, (4096, 8192, 5, 64, 0.5, 64))
    w.stream = 9
    run((P(512), P(1024), 0.25))
    assert w.log[-1][1:] == ((5, 1, 1), 9, None, (512, 1024, 5, 64, 0.25, 64))
    assert w.log[-1][0] == w.log[0][0]  # the same compiled function
    assert w.jit_calls == 1
    # the template keeps no tensor of the recording call alive
    t = next(iter(kl.templates.values()))
    assert t is not None and x not in t.args and x not in t.kargs


def test_scratch_and_unknown_layouts_replay_the_launcher_call() -> None:
    for world in (World("nested", scratch=64), World("swapped")):
        kl = KernelLauncher("k", world.jit("k"), lambda w=world: w.Launcher, lambda d: lambda: 3)
        x = P(4096)
        run, _ = kl.prepare(2, [x, 17], {"num_warps": 1}, (x,), 0)
        assert run.mode == RECORDED_CALL  # type: ignore[attr-defined]
        run((P(32),))
        run((P(48),))
        if world.scratch:  # the launcher allocates fresh scratch for every replay
            assert [e[3] for e in world.log] == [1000, 1001, 1002]
        assert [e[4][0] for e in world.log[-2:]] == [32, 48]


def test_launch_hooks_and_metadata_are_dropped_by_replays() -> None:
    w = World()
    seen: list[Any] = []
    w.hook = seen.append
    kl = KernelLauncher("k", w.jit("k"), lambda: w.Launcher, lambda dev: lambda: 1)
    x = P(16)
    run, _ = kl.prepare(1, [x], {}, (x,), 0)
    assert run.mode == RECORDED and w.hook_calls == 1  # type: ignore[attr-defined]
    run((P(32),))
    run((P(48),))
    assert w.hook_calls == 1 and len(w.log) == 3 and seen == [{"name": "k#0"}]


def test_refusals_keep_the_jit_launch() -> None:
    # the interpreter (no launcher call), a missing driver, recording turned off
    def no_driver() -> type:
        raise RuntimeError("0 active drivers")

    w = World()
    cases = [
        (KernelLauncher("k", w.jit("k", launches=False), lambda: w.Launcher, lambda d: lambda: 0),
         "launcher calls"),
        (KernelLauncher("k", w.jit("k"), no_driver, lambda d: lambda: 0), "0 active drivers"),
        (KernelLauncher("k", w.jit("k"), lambda: w.Launcher, lambda d: lambda: 0, record=False),
         "recording is off"),
    ]  # fmt: skip
    for kl, why in cases:
        before = w.jit_calls
        x = P(16)
        run, launched = kl.prepare(1, [x, 3], {}, (x,), 0)
        assert launched and w.jit_calls == before + 1
        assert run.mode == JIT  # type: ignore[attr-defined]
        run((P(64),))
        assert w.jit_calls == before + 2 and w.log[-1][4][0] == 64
        assert kl.modes() == {RECORDED: 0, RECORDED_CALL: 0, JIT: 1}
        assert why in next(iter(kl.errors.values()))
    assert "__call__" in w.Launcher.__dict__


def test_record_restores_the_launcher_even_when_the_launch_fails() -> None:
    w = World()
    orig = w.Launcher.__call__
    inst = w.Launcher()
    own_launch = inst.launch

    def boom() -> None:
        inst(1, 1, 1, 0, "f", "packed", None, None, None, P(16))
        raise ValueError("compile error")

    with pytest.raises(ValueError):
        record(w.Launcher, boom)
    assert w.Launcher.__call__ is orig and inst.launch == own_launch
    assert "launch" in inst.__dict__

    class Base:
        def __call__(self, *a: Any) -> None:
            pass

    class Derived(Base):
        pass

    seen, _ = record(Derived, lambda: Derived()(1, 2, 3))
    assert "__call__" not in Derived.__dict__ and len(seen) == 1


def test_template_refuses_unknown_calls() -> None:
    with pytest.raises(RecordRefused):
        template_from([], [1])
    x = P(16)
    seen: Any = [(object(), (1, 1, 1, 0, "f", "p", None, None, None, P(16)), [])]
    with pytest.raises(RecordRefused):  # not the same kernel arguments
        template_from(seen, [x])


def test_spec_class_is_a_refinement_of_tritons_specialization() -> None:
    pytest.importorskip("triton")
    torch = pytest.importorskip("torch")
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    base = torch.zeros(64, dtype=torch.float16)
    values: list[Any] = [*range(-40, 70), 2**31 - 16, 2**31, 2**31 + 1, 2**32, 2**63, 2**63 + 16]
    values += [0.5, 1.0, True, False, base, base[1:], base[8:], base.float(), base.bfloat16()[3:]]
    native: dict[Any, set[Any]] = {}
    for v in values:
        got = native_specialize_impl(BaseBackend, v, False, True, True)
        native.setdefault(spec_class(v), set()).add(tuple(map(str, got)))
    assert all(len(s) == 1 for s in native.values()), native


# -- the ops over torch CPU tensors --------------------------------------------------------------


def _sym(log: list[tuple[Any, ...]], tensors: list[Any]) -> list[tuple[Any, ...]]:
    """Launches with pointers named by the tensor they belong to (inputs, then outputs; other
    pointers, of copies the op made, by order of appearance)."""
    names = {t.data_ptr(): f"t{i}" for i, t in enumerate(tensors)}
    out = []
    for _, grid, _, _, args in log:
        named = []
        for a in args:
            if isinstance(a, int) and not isinstance(a, bool) and a > 1 << 20:
                a = names.setdefault(a, f"copy{len(names) - len(tensors)}")
            named.append(a)
        out.append((grid, tuple(named)))
    return out


def _flat(res: Any) -> list[Any]:
    return list(res) if isinstance(res, tuple) else [res]


def _calls(torch: Any) -> list[tuple[str, Callable[[], tuple[Any, ...]]]]:
    """(op, fresh inputs) call sequences: repeated keys, changing rows, growing spans, views."""
    h = torch.float16

    def rnd(*s: int, dtype: Any = h) -> Any:
        return torch.randn(*s).to(dtype)

    def rope_in(b: int, s: int) -> tuple[Any, ...]:
        q = rnd(b, s, 4, 16).transpose(1, 2)
        k = rnd(b, s, 2, 16).transpose(1, 2)
        return q, k, rnd(b, s, 16), rnd(1, s, 16)

    def sm_in(sk: int, mask: bool) -> tuple[Any, ...]:
        m = torch.zeros(2, 1, 1, sk + 5, dtype=h) if mask else None
        return rnd(2, 4, 1, sk), m, 0.125

    seq: list[tuple[str, Callable[[], tuple[Any, ...]]]] = []
    for rows in (1, 3, 3, 5, 7, 16, 3, 1):
        seq.append(("rms_norm", lambda r=rows: (rnd(r, 64), rnd(64), 1e-6)))
        seq.append(("add_rms_norm", lambda r=rows: (rnd(2, r, 64), rnd(2, r, 64), rnd(64), 1e-5)))
        seq.append(("swiglu", lambda r=rows: tuple(rnd(r, 96).chunk(2, -1))))
        seq.append(("rope", lambda r=rows: rope_in(2, r)))
    for sk in (77, 78, 79, 80, 81, 77):
        seq.append(("masked_softmax", lambda s=sk: sm_in(s, True)))
        seq.append(("masked_softmax", lambda s=sk: sm_in(s, False)))
    # views: an odd pointer offset, a non-unit last stride (copied), mixed dtypes, zero rows
    seq.append(("rms_norm", lambda: (rnd(4, 80)[:, 1:65], rnd(64), 1e-6)))
    seq.append(("rms_norm", lambda: (rnd(64, 4).t(), rnd(64, dtype=torch.float32), 1e-6)))
    seq.append(("rms_norm", lambda: (rnd(0, 64), rnd(64), 1e-6)))
    seq.append(
        ("add_rms_norm", lambda: (rnd(3, 64), rnd(3, 64, dtype=torch.float32), rnd(64), 0.1))
    )
    return seq


@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_ops_launch_what_the_jit_path_launches(layout: str) -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    rec_w, jit_w = World(layout), World(layout)
    rec, jit = rec_w.ops(max_programs=4), jit_w.ops(max_programs=4, record=False)
    for _ in range(2):  # the second pass replays every exact key with new tensors
        for op, make in _calls(torch):
            args = make()
            n0, n1 = len(rec_w.log), len(jit_w.log)
            a = _flat(getattr(rec, op)(*args))
            b = _flat(getattr(jit, op)(*args))
            assert [(t.shape, t.stride(), t.dtype) for t in a] == [
                (t.shape, t.stride(), t.dtype) for t in b
            ]
            ins = [t for t in args if hasattr(t, "data_ptr")]
            got = _sym(rec_w.log[n0:], ins + a)
            want = _sym(jit_w.log[n1:], ins + b)
            assert got == want, (op, got, want)
    paths = rec.paths()
    assert paths["path"] == RECORDED and not paths["errors"]
    assert jit.paths()["path"] == JIT
    # Triton's JIT path ran once per specialization key, never for a replay
    specs = sum(sum(kl.modes().values()) for kl in rec.launchers.values())
    assert rec_w.jit_calls == specs
    assert jit_w.jit_calls == len(jit_w.log)


def test_replays_write_this_calls_pointers_and_stream() -> None:
    torch = pytest.importorskip("torch")
    w = World()
    ops = w.ops()
    weight = torch.randn(64).half()
    for i in range(4):
        w.stream = 100 + i
        x = torch.randn(3, 64).half()
        y = ops.rms_norm(x, weight, 1e-6 * (i + 1))
        _, grid, stream, _, args = w.log[-1]
        assert grid == (3, 1, 1) and stream == 100 + i
        assert args[:5] == (x.data_ptr(), x.data_ptr(), weight.data_ptr(), y.data_ptr(),
                            y.data_ptr())  # fmt: skip
        assert args[5:] == (3, 64, 64, 0, 64, 0, 1e-6 * (i + 1), False, 64)
    assert w.jit_calls == 1 and ops.paths()["ops"]["rms_norm"][RECORDED] == 1


def test_growing_attention_span_needs_no_new_jit_launch_within_a_class() -> None:
    torch = pytest.importorskip("torch")
    w = World()
    ops = w.ops()
    mask = torch.zeros(2, 1, 1, 200).half()
    for sk in (97, 98, 99, 101, 102, 103):  # none divisible by 8: one specialization
        ops.masked_softmax(torch.randn(2, 4, 1, sk).half(), mask, 0.1)
    assert w.jit_calls == 1 and len(w.log) == 6
    assert [e[4][4] for e in w.log] == [97, 98, 99, 101, 102, 103]  # N written per key
    assert len(ops.tables["masked_softmax"]) == 6


def test_ops_under_refused_recording_keep_the_jit_path() -> None:
    torch = pytest.importorskip("torch")
    w = World()
    kernels = {
        k: w.jit(k, launches=False) for k in ("rms_norm", "rope", "masked_softmax", "swiglu")
    }
    ops = DecodeOps(kernels, lambda: w.Launcher, lambda d: lambda: 0)
    x, wt = torch.randn(2, 32).half(), torch.randn(32).half()
    for _ in range(3):
        ops.rms_norm(x, wt, 1e-6)
    assert w.jit_calls == 3 and ops.paths()["path"] == JIT
    assert "0 launcher calls" in ops.paths()["errors"][0]


def test_width_limit_raises_and_caches_nothing() -> None:
    torch = pytest.importorskip("torch")
    ops = World().ops(max_width=128)
    with pytest.raises(ValueError, match="exceeds 128"):
        ops.rms_norm(torch.randn(2, 256).half(), torch.randn(256).half(), 1e-6)
    assert not ops.tables["rms_norm"]
