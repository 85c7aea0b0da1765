"""Plain records the store returns besides the pydantic models: cheap, immutable, typed."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple


class DispatchRow(NamedTuple):
    """One entry as the dispatcher reads it (``Store.family_rows``): no parsing, no objects.

    The config text is not included; ``Store.entry_config(id)`` reads it for the one row
    the dispatcher chooses.
    """

    id: int
    tokens: int
    routing_class: str
    config_hash: str
    fingerprint_hash: str | None
    status: str
    speedup: float | None


@dataclass(frozen=True)
class Claim:
    """A worker's hold on one point of a job, valid while its token is the point's token."""

    job: str
    key: str
    payload: dict[str, Any] = field(compare=False, hash=False)
    worker: str
    token: str
    expires_at: datetime


@dataclass(frozen=True)
class PointState:
    """Where one point of a job stands: pending, claimed (by ``worker``) or done."""

    key: str
    state: str
    worker: str | None
    attempts: int
    expires_at: datetime | None = None
