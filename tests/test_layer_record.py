"""MoELayer's launch recorder against a stand-in Triton launcher (a GPU host: the layer imports
FlagGems, which needs a GPU; no kernel is launched).

The recorder must bind the call's own tensors into the plan, and refuse (so the layer keeps its
pipeline) when Triton hands the kernel arguments over in a layout it does not know.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")


class FakeLauncher:
    launch_cooperative_grid = False
    launch_pdl = False

    def __init__(self, nested: bool) -> None:
        self.nested = nested
        self.calls: list[tuple[Any, ...]] = []

    def launch(self, *args: Any) -> None:
        self.calls.append(args)

    def __call__(self, gx: int, gy: int, gz: int, stream: Any, function: Any, *args: Any) -> None:
        self.calls.append((gx, gy, gz, stream, function, *args))


class FakePipe:
    """Two Triton steps reading the call's x and writing its output, like a pipeline's GEMMs."""

    def __init__(self, launcher: FakeLauncher, device: str = "cuda") -> None:
        self.launcher = launcher
        self.out = torch.zeros(2, 4, device=device)

    def steps(self, x: Any, tw: Any, ids: Any, out: Any) -> list[tuple[str, Any]]:
        def gemm() -> None:
            kernel_args: tuple[Any, ...] = (x, ids, out, 7)
            meta = ("packed", "launch-meta", "enter-hook", "exit-hook")
            if self.launcher.nested:
                self.launcher(1, 1, 1, 0, "fn", *meta, kernel_args)
            else:
                self.launcher(1, 1, 1, 0, "fn", *meta, *kernel_args)

        return [("triton", gemm)]


@pytest.fixture()
def fake_driver(monkeypatch: pytest.MonkeyPatch) -> Any:
    pytest.importorskip("flag_gems")
    from triton.runtime import driver

    class Active:
        launcher_cls = FakeLauncher

    monkeypatch.setattr(driver, "_active", Active(), raising=False)
    monkeypatch.setattr(type(driver), "active", property(lambda self: Active()), raising=False)
    return driver


def test_flat_layout_is_recorded_and_binds_the_calls_tensors(fake_driver: Any) -> None:
    from mxdb.kernels.layer import record_plan

    launcher = FakeLauncher(nested=False)
    pipe = FakePipe(launcher)
    # CUDA tensors: the replay reads the current stream of the call's device (nothing launches)
    x, tw = torch.ones(2, 4, device="cuda"), torch.ones(2, 1, device="cuda")
    ids = torch.zeros(2, 1, dtype=torch.int64, device="cuda")
    plan = record_plan(pipe, x, tw, ids)  # type: ignore[arg-type]
    launcher.calls.clear()
    x2 = torch.full((2, 4), 2.0, device="cuda")
    plan(x2, tw, ids)
    [args] = launcher.calls
    assert any(a is x2 for a in args) and not any(a is x for a in args)
    assert None in args[:9]  # launch hooks dropped from the replay


def test_nested_layout_is_refused(fake_driver: Any) -> None:
    from mxdb.kernels.layer import record_plan

    pipe = FakePipe(FakeLauncher(nested=True))
    x, tw = torch.ones(2, 4, device="cuda"), torch.ones(2, 1, device="cuda")
    ids = torch.zeros(2, 1, dtype=torch.int64, device="cuda")
    with pytest.raises(RuntimeError, match="layout this recorder does not know"):
        record_plan(pipe, x, tw, ids)  # type: ignore[arg-type]
