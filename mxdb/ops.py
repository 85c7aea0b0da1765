"""The ops the store and dispatcher serve, and how each one's stored config is parsed.

The store and the dispatcher are generic over the op: an entry's config is
JSON, and this registry turns it into the op's config object.  The fused-MoE
layer's config is a ``KernelConfig``; an op without a registered parser (for
example a decode op whose choice is an implementation name) gets a read-only
mapping of its JSON.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType
from typing import Any

from mxdb.configs import KernelConfig
from mxdb.shapes import MOE_OP

_PARSERS: dict[str, Callable[[Any], Any]] = {MOE_OP: KernelConfig.parse}


def register_op(op: str, parser: Callable[[Any], Any]) -> None:
    """Make ``parser`` turn stored config JSON (a dict) of ``op`` into its config object."""
    _PARSERS[op] = parser


def parse_config(op: str, data: Any) -> Any:
    """The config object of ``op`` for the stored JSON ``data``."""
    parser = _PARSERS.get(op)
    if parser is not None:
        return parser(data)
    return MappingProxyType(dict(data))


def config_to_json(config: Any) -> Any:
    """The JSON form of any op's config object."""
    if hasattr(config, "model_dump"):
        return config.model_dump()
    return dict(config)
