"""The store's tables as SQLAlchemy Core objects: what the queries are written against.

The migrations in ``mxdb/store/migrations/versions`` create these tables; they do
not import this module (a migration must keep describing the schema of its own
revision).  ``tests/test_store_migrations.py`` checks that head matches this module.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Dialect,
    Float,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    func,
    literal_column,
)
from sqlalchemy.types import TypeDecorator

#: Key of the meta row holding the generation counter.
GENERATION_KEY = "generation"


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend.

    PostgreSQL stores ``timestamptz``; SQLite has no time zones, so the value is
    stored as naive UTC text and made aware again when read.  A naive value given
    by a caller is taken to be UTC already.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if not isinstance(value, datetime):
            raise TypeError(f"expected a datetime, got {type(value).__name__}")
        aware: datetime = value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value
        aware = aware.astimezone(timezone.utc)
        return aware.replace(tzinfo=None) if dialect.name == "sqlite" else aware

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        assert isinstance(value, datetime)
        stored: datetime = value
        if stored.tzinfo is None:
            return stored.replace(tzinfo=timezone.utc)
        return stored.astimezone(timezone.utc)


metadata = MetaData()

meta = Table(
    "meta",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)

fingerprints = Table(
    "fingerprints",
    metadata,
    Column("hash", String(64), primary_key=True),
    Column("components", Text, nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
)

entries = Table(
    "entries",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("op", String(64), nullable=False),
    Column("dtype", String(16), nullable=False),
    Column("family", String(128), nullable=False),
    Column("dims", Text, nullable=False),
    Column("tokens", Integer, nullable=False),
    Column("routing_class", String(32), nullable=False),
    Column("config", Text, nullable=False),
    Column("config_hash", String(64), nullable=False),
    Column("fingerprint_hash", String(64), nullable=True),
    Column("device_name", String(256), nullable=True),
    Column("status", String(16), nullable=False),
    Column("source", String(64), nullable=False),
    Column("speedup", Float, nullable=True),
    Column("noise_band", Float, nullable=True),
    Column("median_us", Float, nullable=True),
    Column("baseline_us", Float, nullable=True),
    Column("evidence", Text, nullable=True),
    Column("stale_reason", Text, nullable=True),
    Column("confidence", Float, nullable=True),
    Column("validation", Text, nullable=True),
    Column("job", String(128), nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
)
# The dispatcher's lookup of a family: a covering index (no config text), revision 0003.
Index(
    "ix_entries_dispatch",
    entries.c.op,
    entries.c.dtype,
    entries.c.family,
    entries.c.tokens,
    entries.c.routing_class,
    entries.c.status,
    entries.c.fingerprint_hash,
    entries.c.config_hash,
    entries.c.speedup,
    entries.c.noise_band,
    entries.c.id,
)
# The natural key.  fingerprint_hash may be NULL, and NULLs never collide in a unique
# index, so the index is on COALESCE(fingerprint_hash, '') (same on SQLite and PostgreSQL).
# The device is part of it (revision 0004): vLLM's configs folder holds one table per
# device for the same (E, N), often with the same config at the same M.
NATURAL_KEY_FP = func.coalesce(entries.c.fingerprint_hash, literal_column("''"))
NATURAL_KEY_DEVICE = func.coalesce(entries.c.device_name, literal_column("''"))
Index(
    "uq_entries_natural_key_device",
    entries.c.op,
    entries.c.dtype,
    entries.c.family,
    entries.c.tokens,
    entries.c.routing_class,
    NATURAL_KEY_FP,
    NATURAL_KEY_DEVICE,
    entries.c.source,
    entries.c.config_hash,
    unique=True,
)
Index("ix_entries_fingerprint_hash", entries.c.fingerprint_hash)
# Every row of one tuning job (revision 0006).
Index("ix_entries_job", entries.c.job)

measurements = Table(
    "measurements",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_id", String(128), nullable=False, unique=True),
    Column("op", String(64), nullable=False),
    Column("dtype", String(16), nullable=False),
    Column("family", String(128), nullable=False),
    Column("dims", Text, nullable=False),
    Column("tokens", Integer, nullable=False),
    Column("routing_class", String(32), nullable=False),
    Column("trace_hash", String(64), nullable=True),
    Column("seed", BigInteger, nullable=True),
    Column("config", Text, nullable=False),
    Column("config_hash", String(64), nullable=False),
    Column("role", String(16), nullable=False),
    Column("fidelity", String(16), nullable=False),
    Column("status", String(16), nullable=False),
    Column("error", Text, nullable=True),
    Column("samples_us", Text, nullable=False),
    Column("median_us", Float, nullable=True),
    Column("p90_us", Float, nullable=True),
    Column("max_abs_err", Float, nullable=True),
    Column("rel_err", Float, nullable=True),
    Column("timing_method", String(64), nullable=True),
    Column("fingerprint_hash", String(64), nullable=True),
    Column("point", String(128), nullable=True),
    Column("comparison", String(64), nullable=True),
    Column("margin", Float, nullable=True),
    Column("order_seed", BigInteger, nullable=True),
    Column("job", String(128), nullable=True),
    Column("decision_rule", Integer, nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
)
Index(
    "ix_measurements_op_family_tokens",
    measurements.c.op,
    measurements.c.family,
    measurements.c.tokens,
)
Index("ix_measurements_job", measurements.c.job)

work_points = Table(
    "work_points",
    metadata,
    Column("job", String(128), nullable=False),
    Column("key", String(256), nullable=False),
    Column("payload", Text, nullable=False),
    Column("state", String(16), nullable=False),
    Column("worker", String(128), nullable=True),
    Column("token", String(64), nullable=True),
    Column("expires_at", UTCDateTime, nullable=True),
    Column("attempts", Integer, nullable=False),
    Column("updated_at", UTCDateTime, nullable=False),
    PrimaryKeyConstraint("job", "key", name="pk_work_points"),
)
Index("ix_work_points_job_state", work_points.c.job, work_points.c.state)

#: Tables of each revision, for the "is this an mxdb database?" check.
MXDB_TABLES = frozenset({"meta", "fingerprints", "entries", "measurements", "work_points"})
