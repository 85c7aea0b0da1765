"""A covering index for the dispatcher's first lookup of a shape family.

The dispatcher reads every entry of one (op, dtype, family) without its config
text; with this index SQLite and PostgreSQL answer from the index alone.

Revision ID: 0003
Revises: 0002
Create Date: 2025-01-03
"""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

COLUMNS = [
    "op", "dtype", "family", "tokens", "routing_class", "status",
    "fingerprint_hash", "config_hash", "speedup", "noise_band", "id",
]


def upgrade() -> None:
    op.drop_index("ix_entries_op_dtype_family", table_name="entries")
    op.create_index("ix_entries_dispatch", "entries", COLUMNS)


def downgrade() -> None:
    op.drop_index("ix_entries_dispatch", table_name="entries")
    op.create_index("ix_entries_op_dtype_family", "entries", ["op", "dtype", "family"])
