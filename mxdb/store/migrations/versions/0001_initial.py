"""Initial schema: meta (with the generation counter), fingerprints, entries, measurements.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    meta = op.create_table(
        "meta",
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("value", sa.Text, nullable=False),
    )
    op.bulk_insert(meta, [{"key": "generation", "value": "0"}])

    op.create_table(
        "fingerprints",
        sa.Column("hash", sa.String(64), primary_key=True),
        sa.Column("components", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )

    op.create_table(
        "entries",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("op", sa.String(64), nullable=False),
        sa.Column("dtype", sa.String(16), nullable=False),
        sa.Column("family", sa.String(128), nullable=False),
        sa.Column("dims", sa.Text, nullable=False),
        sa.Column("tokens", sa.Integer, nullable=False),
        sa.Column("routing_class", sa.String(32), nullable=False),
        sa.Column("config", sa.Text, nullable=False),
        sa.Column("config_hash", sa.String(64), nullable=False),
        sa.Column("fingerprint_hash", sa.String(64), nullable=True),
        sa.Column("device_name", sa.String(256), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("source", sa.String(64), nullable=False),
        sa.Column("speedup", sa.Float, nullable=True),
        sa.Column("noise_band", sa.Float, nullable=True),
        sa.Column("median_us", sa.Float, nullable=True),
        sa.Column("baseline_us", sa.Float, nullable=True),
        sa.Column("evidence", sa.Text, nullable=True),
        sa.Column("stale_reason", sa.Text, nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_entries_op_dtype_family", "entries", ["op", "dtype", "family"])
    # NULL fingerprint hashes never collide in a unique index: index COALESCE(..., '').
    op.create_index(
        "uq_entries_natural_key",
        "entries",
        [
            "op",
            "dtype",
            "family",
            "tokens",
            "routing_class",
            sa.text("coalesce(fingerprint_hash, '')"),
            "source",
            "config_hash",
        ],
        unique=True,
    )
    op.create_index("ix_entries_fingerprint_hash", "entries", ["fingerprint_hash"])

    op.create_table(
        "measurements",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(128), nullable=False, unique=True),
        sa.Column("op", sa.String(64), nullable=False),
        sa.Column("dtype", sa.String(16), nullable=False),
        sa.Column("family", sa.String(128), nullable=False),
        sa.Column("dims", sa.Text, nullable=False),
        sa.Column("tokens", sa.Integer, nullable=False),
        sa.Column("routing_class", sa.String(32), nullable=False),
        sa.Column("trace_hash", sa.String(64), nullable=True),
        sa.Column("seed", sa.BigInteger, nullable=True),
        sa.Column("config", sa.Text, nullable=False),
        sa.Column("config_hash", sa.String(64), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("fidelity", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("samples_us", sa.Text, nullable=False),
        sa.Column("median_us", sa.Float, nullable=True),
        sa.Column("p90_us", sa.Float, nullable=True),
        sa.Column("max_abs_err", sa.Float, nullable=True),
        sa.Column("rel_err", sa.Float, nullable=True),
        sa.Column("timing_method", sa.String(64), nullable=True),
        sa.Column("fingerprint_hash", sa.String(64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index(
        "ix_measurements_op_family_tokens", "measurements", ["op", "family", "tokens"]
    )


def downgrade() -> None:
    op.drop_table("measurements")
    op.drop_table("entries")
    op.drop_table("fingerprints")
    op.drop_table("meta")
