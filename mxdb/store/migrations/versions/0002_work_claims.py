"""Work claims: the points of a tuning job, claimed by workers under a lease.

Revision ID: 0002
Revises: 0001
Create Date: 2025-01-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "work_points",
        sa.Column("job", sa.String(128), nullable=False),
        sa.Column("key", sa.String(256), nullable=False),
        sa.Column("payload", sa.Text, nullable=False),
        # pending | claimed | done
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("worker", sa.String(128), nullable=True),
        sa.Column("token", sa.String(64), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("job", "key", name="pk_work_points"),
    )
    op.create_index("ix_work_points_job_state", "work_points", ["job", "state"])


def downgrade() -> None:
    op.drop_table("work_points")
