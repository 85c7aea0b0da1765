"""mxdb: a database of verified, routing-aware Triton kernel configs for fused-MoE layers.

The core is GPU-free: importing ``mxdb`` never imports torch, triton or
flag_gems.  The GPU layer is ``mxdb.kernels``, imported only on demand.

    >>> import mxdb
    >>> shape = mxdb.MoEShape(experts=8, hidden=4096, intermediate=14336, topk=2, tokens=4,
    ...                       dtype="bf16")
    >>> decision = mxdb.dispatch(shape, "uniform")      # doctest: +SKIP
    >>> decision.config, decision.level, decision.reason  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mxdb.configs import GemmConfig, KernelConfig
from mxdb.decision import Decision
from mxdb.dispatcher import Dispatcher, DispatchOptions, configure, dispatch
from mxdb.errors import MxdbError
from mxdb.shapes import MoEShape
from mxdb.version import __version__

if TYPE_CHECKING:
    from mxdb.runtime.hook import Hook


def install(
    dispatcher: Dispatcher | None = None, *, monitor_every: int = 1024, **options: Any
) -> Hook:
    """Make FlagGems' fused-MoE path take its configs from mxdb (see ``mxdb.runtime.hook``)."""
    from mxdb.runtime.hook import install as _install

    return _install(dispatcher, monitor_every=monitor_every, **options)


def uninstall() -> bool:
    """Restore FlagGems' own functions; False when the hook was not installed."""
    from mxdb.runtime.hook import uninstall as _uninstall

    return _uninstall()


__all__ = [
    "Decision",
    "DispatchOptions",
    "Dispatcher",
    "GemmConfig",
    "KernelConfig",
    "MoEShape",
    "MxdbError",
    "__version__",
    "configure",
    "dispatch",
    "install",
    "uninstall",
]
