"""Entries and measurements name the tuning job that wrote them; measurements the rule.

Measurements also get ``decision_rule`` (nullable integer): the ``mxdb.pointverdict`` rule the
tuner decided their point by (NULL for rows written before: rule 1), so that a job's bundle
says which rule its store export was made by, whatever mxdb writes the bundle.

Until 0005 a job's rows were found by prefixes: the tuner names its runs
``<job tag>-<point tag>-<6 hex>-...`` (the tags: the first 8 hex digits of the SHA-256 of the
job's name and of the point's key) and an entry's ``evidence`` is the run id that decided it.
A nullable ``job`` column, indexed, now says it; the tuner sets it on every row it writes.

Backfill of the rows already stored, from the jobs whose points are in ``work_points``:
a measurement whose ``run_id``, or an entry whose ``evidence``, starts with
``<job tag>-<point tag>-`` gets that job when exactly one job in ``work_points`` has that job
tag (two jobs whose tags collide claim none of their rows) and that job has a point whose key
has that point tag.  Every other row (imported entries, rows of jobs whose points are gone,
decode tuning's rows) keeps ``job`` NULL.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

import hashlib

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

#: "<8 hex>-<8 hex>-": the job tag and point tag that open a tuner's run id.
_PREFIX_LEN = 18


def _tag(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _prefixes(conn: sa.engine.Connection) -> dict[str, str]:
    """``<job tag>-<point tag>-`` -> job, for the tags only one job in work_points has."""
    pairs = conn.execute(sa.text("SELECT job, key FROM work_points")).all()
    jobs_of_tag: dict[str, set[str]] = {}
    for job, _ in pairs:
        jobs_of_tag.setdefault(_tag(job), set()).add(job)
    out: dict[str, str] = {}
    for job, key in pairs:
        if len(jobs_of_tag[_tag(job)]) == 1:
            out[f"{_tag(job)}-{_tag(key)}-"] = job
    return out


def upgrade() -> None:
    with op.batch_alter_table("entries") as batch:
        batch.add_column(sa.Column("job", sa.String(128), nullable=True))
    with op.batch_alter_table("measurements") as batch:
        batch.add_column(sa.Column("job", sa.String(128), nullable=True))
        batch.add_column(sa.Column("decision_rule", sa.Integer, nullable=True))
    # "every row of job X": the bundle and report of a job
    op.create_index("ix_entries_job", "entries", ["job"])
    op.create_index("ix_measurements_job", "measurements", ["job"])

    conn = op.get_bind()
    for prefix, job in sorted(_prefixes(conn).items()):
        params = {"job": job, "prefix": prefix, "n": _PREFIX_LEN}
        conn.execute(
            sa.text(
                "UPDATE measurements SET job = :job"
                " WHERE job IS NULL AND substr(run_id, 1, :n) = :prefix"
            ),
            params,
        )
        conn.execute(
            sa.text(
                "UPDATE entries SET job = :job"
                " WHERE job IS NULL AND evidence IS NOT NULL AND substr(evidence, 1, :n) = :prefix"
            ),
            params,
        )


def downgrade() -> None:
    op.drop_index("ix_measurements_job", table_name="measurements")
    op.drop_index("ix_entries_job", table_name="entries")
    with op.batch_alter_table("measurements") as batch:
        batch.drop_column("decision_rule")
        batch.drop_column("job")
    with op.batch_alter_table("entries") as batch:
        batch.drop_column("job")
