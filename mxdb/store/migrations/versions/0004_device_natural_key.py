"""The device joins the entries' natural key.

vLLM's configs folder holds, for one (E, N), a table per device, and two devices' tables often
share a config at the same M: without the device in the key, importing the whole folder kept
only the first of such rows.  Every key unique under 0001's index stays unique under this one.

Revision ID: 0004
Revises: 0003
Create Date: 2025-01-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_BEFORE = ["op", "dtype", "family", "tokens", "routing_class"]


def upgrade() -> None:
    op.drop_index("uq_entries_natural_key", table_name="entries")
    op.create_index(
        "uq_entries_natural_key_device",
        "entries",
        [
            *_BEFORE,
            sa.text("coalesce(fingerprint_hash, '')"),
            sa.text("coalesce(device_name, '')"),
            "source",
            "config_hash",
        ],
        unique=True,
    )


def downgrade() -> None:
    # Rows that differ only by device would collide under the old key: refuse rather than
    # drop them silently.
    op.drop_index("uq_entries_natural_key_device", table_name="entries")
    op.create_index(
        "uq_entries_natural_key",
        "entries",
        [*_BEFORE, sa.text("coalesce(fingerprint_hash, '')"), "source", "config_hash"],
        unique=True,
    )
