"""Schema migrations, run programmatically with Alembic when a store is opened.

The migration scripts live in ``mxdb/store/migrations``.  Opening a database:
1. reads its revision in a read transaction (the common case: already at head, done);
2. refuses a revision this mxdb does not know (written by a newer mxdb) and a
   database that has tables but no mxdb revision (not an mxdb database), touching
   nothing;
3. otherwise upgrades inside one write transaction that holds the database's write
   lock (SQLite: BEGIN IMMEDIATE; PostgreSQL: an advisory lock), so concurrent
   openers of a fresh database do not race, and a failed upgrade leaves it as it was.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, inspect, text
from sqlalchemy.engine import Connection

from mxdb.errors import SchemaTooNewError, StoreError
from mxdb.store.engine import BEGIN_OPTION, make_engine, normalize_url, sqlite_path

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"

#: Key of PostgreSQL's transaction-level advisory lock that serializes migrations.
_PG_MIGRATION_LOCK = 0x6D786462  # "mxdb"


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return cfg


@lru_cache(maxsize=1)
def script_directory() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config())


def head_revision() -> str:
    """The newest schema revision this mxdb knows."""
    head = script_directory().get_current_head()
    assert head is not None
    return head


def known_revisions() -> frozenset[str]:
    return frozenset(rev.revision for rev in script_directory().walk_revisions())


def current_revisions(conn: Connection) -> tuple[str, ...]:
    """The revisions stamped in the database (empty for a database without mxdb's schema)."""
    return tuple(MigrationContext.configure(conn).get_current_heads())


def _check(conn: Connection, display_url: str) -> tuple[str, ...]:
    current = current_revisions(conn)
    tables: list[str] = []
    if not current:
        tables = sorted(t for t in inspect(conn).get_table_names() if t != "alembic_version")
        if tables:
            # Read again: outside the migration lock (PostgreSQL, read committed) another
            # opener's migration may have committed between the two reads, tables and stamp
            # at once; with its tables visible, its stamp is too.
            current = current_revisions(conn)
    unknown = [rev for rev in current if rev not in known_revisions()]
    if unknown:
        raise SchemaTooNewError(
            f"database at {display_url} has schema revision {', '.join(unknown)}, newer than "
            f"this mxdb knows (head {head_revision()}); upgrade mxdb (pip install -U mxdb) "
            "or use another --db"
        )
    if tables and not current:
        shown = ", ".join(tables[:5]) + (", ..." if len(tables) > 5 else "")
        raise StoreError(
            f"database at {display_url} has tables ({shown}) but no mxdb schema revision; "
            "it is not an mxdb database: use an empty database or another --db"
        )
    return current


def ensure_schema(engine: Engine, display_url: str, revision: str = "head") -> None:
    """Bring the database to ``revision`` (head by default); see the module docstring."""
    target = head_revision() if revision == "head" else revision
    with engine.connect() as conn, conn.begin():
        if _check(conn, display_url) == (target,):
            return
    writer = engine.execution_options(**{BEGIN_OPTION: "IMMEDIATE"})
    with writer.connect() as conn, conn.begin():
        if engine.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_MIGRATION_LOCK})
        # Checked again under the lock: another process may have migrated meanwhile.
        if _check(conn, display_url) == (target,):
            return
        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, target)


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at ``url`` to ``revision`` without opening a store."""
    parsed = normalize_url(url)
    path = sqlite_path(parsed)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    engine = make_engine(parsed)
    try:
        ensure_schema(engine, parsed.render_as_string(hide_password=True), revision)
    finally:
        engine.dispose()
