"""Held-out validation: entries carry their confidence and validation record; measurements
name the tuning point and interleaved comparison they belong to.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("entries") as batch:
        batch.add_column(sa.Column("confidence", sa.Float, nullable=True))
        batch.add_column(sa.Column("validation", sa.Text, nullable=True))
    with op.batch_alter_table("measurements") as batch:
        batch.add_column(sa.Column("point", sa.String(128), nullable=True))
        batch.add_column(sa.Column("comparison", sa.String(64), nullable=True))
        batch.add_column(sa.Column("margin", sa.Float, nullable=True))
        batch.add_column(sa.Column("order_seed", sa.BigInteger, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("measurements") as batch:
        for name in ("order_seed", "margin", "comparison", "point"):
            batch.drop_column(name)
    with op.batch_alter_table("entries") as batch:
        batch.drop_column("validation")
        batch.drop_column("confidence")
