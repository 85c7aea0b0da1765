"""The protocol between the tuner and whatever measures kernel configs.

``mxdb.kernels.backend.GpuBackend`` implements it on a GPU; ``mxdb.tune.fake.FakeBackend``
implements it with an analytic cost model for CPU tests.  Failures (out of resources, compile
errors, timeouts, wrong results) are *results* (``mxdb.results``), never exceptions: the tuner
records them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from mxdb.configs import KernelConfig
    from mxdb.models import Fingerprint
    from mxdb.profiles import DeviceProfile
    from mxdb.results import CompileResult, Correctness, Timing
    from mxdb.shapes import MoEShape

#: Timing methods a backend may be asked for.
TIMING_METHODS: tuple[str, ...] = ("graph", "eager")


@runtime_checkable
class Backend(Protocol):
    """What the tuner needs from a measuring device."""

    name: str

    def fingerprint(self) -> Fingerprint:
        """The live environment fingerprint."""
        ...

    def profile(self) -> DeviceProfile:
        """The device's resource profile (shared memory, registers, warp size...)."""
        ...

    def baseline_config(self, shape: MoEShape) -> KernelConfig:
        """FlagGems' own choice for this call: the baseline every speedup is measured against."""
        ...

    def compile(self, shape: MoEShape, configs: Sequence[KernelConfig]) -> list[CompileResult]:
        """Compile every config (in parallel on host cores); one result per config, in order."""
        ...

    def time(
        self,
        shape: MoEShape,
        topk_ids: np.ndarray,
        configs: Sequence[KernelConfig],
        *,
        reps: int,
        seed: int,
        method: str = "graph",
        order_seed: int | None = None,
    ) -> list[Timing]:
        """Time every config on the same inputs and routing, interleaved in rounds.

        Each of the ``reps`` rounds times every config once; sample ``r`` of every config
        belongs to round ``r``.  With ``order_seed`` the order within each round is a random
        permutation drawn from it (a fixed order biases the comparison); without it, the order
        given.  ``configs`` may repeat (same-config copies).  ``method`` is "graph" (CUDA-graph
        replay of the whole layer) or "eager".  One Timing per config, in the order given.
        """
        ...

    def check(
        self, shape: MoEShape, topk_ids: np.ndarray, config: KernelConfig, *, seed: int
    ) -> Correctness:
        """Run the whole layer with ``config`` and compare it with the float32 reference."""
        ...
