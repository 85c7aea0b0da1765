"""Database URLs and engines: SQLite tuned for many concurrent writers, PostgreSQL as is.

SQLite's own (pysqlite) transaction handling begins transactions lazily and as
DEFERRED, so two writers can both hold a read lock and then deadlock on the upgrade
to a write lock; SQLite reports that at once as "database is locked", without
waiting on busy_timeout.  So mxdb turns pysqlite's handling off and emits BEGIN
itself (SQLAlchemy's documented recipe): ``BEGIN IMMEDIATE`` for write
transactions (the write lock is taken up front, waiting up to busy_timeout) and a
plain deferred ``BEGIN`` for reads.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

import platformdirs
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.exc import ArgumentError, OperationalError

from mxdb.errors import StoreError

#: How long a SQLite writer waits for the write lock before giving up (milliseconds).
SQLITE_BUSY_TIMEOUT_MS = 30_000

#: Execution option naming how a SQLite transaction begins: "IMMEDIATE" (writes) or
#: "DEFERRED" (reads, the default).
BEGIN_OPTION = "mxdb_sqlite_begin"


def default_url() -> str:
    """``$MXDB_DB`` if set, else a SQLite file in the user's cache directory."""
    env = os.environ.get("MXDB_DB", "").strip()
    if env:
        return env
    return f"sqlite:///{Path(platformdirs.user_cache_dir('mxdb')) / 'mxdb.sqlite'}"


def normalize_url(url: str) -> URL:
    """Parse ``url``: any SQLAlchemy URL, or a plain path (taken as a SQLite file).

    ``postgresql://`` without a driver means psycopg 3, the driver mxdb supports.
    """
    text = url.strip()
    if not text:
        raise StoreError("an empty database URL was given; pass a SQLAlchemy URL or a file path")
    if "://" not in text:
        text = f"sqlite:///{Path(text).expanduser().absolute()}"
    try:
        parsed = make_url(text)
    except ArgumentError as exc:
        raise StoreError(
            f"{url!r} is not a database URL ({exc}); use e.g. sqlite:////path/to/mxdb.sqlite "
            "or postgresql+psycopg://user@host/dbname"
        ) from None
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def sqlite_path(url: URL) -> Path | None:
    """The file of a SQLite URL, or None for an in-memory database or another backend."""
    if url.get_backend_name() != "sqlite":
        return None
    database = url.database or ""
    if database in ("", ":memory:") or database.startswith("file:"):
        return None
    return Path(database)


def make_engine(url: URL, *, readonly: bool = False) -> Engine:
    """An engine for ``url``; for SQLite, with WAL, busy_timeout and explicit BEGINs.

    ``readonly`` (SQLite files only): open with ``mode=ro`` (and ``immutable=1`` when the
    folder is not writable either, so that SQLite needs no -shm file), and leave the
    journal mode as it is.
    """
    backend = url.get_backend_name()
    kwargs: dict[str, Any] = {}
    path = sqlite_path(url)
    if readonly and path is not None:
        from urllib.parse import quote

        immutable = "" if os.access(path.parent, os.W_OK) else "&immutable=1"
        uri = f"file:{quote(str(path.absolute()))}?mode=ro{immutable}"
        kwargs["creator"] = lambda: sqlite3.connect(uri, uri=True, check_same_thread=False)
    if backend == "postgresql":
        # Recycle server connections now and then; no pre-ping, which would cost a
        # round trip on every checkout (the dispatcher's reads are latency-bound).
        kwargs["pool_recycle"] = 1800
    try:
        engine = create_engine(url, **kwargs)
    except ModuleNotFoundError as exc:
        hint = " (pip install 'mxdb[postgres]')" if backend == "postgresql" else ""
        raise StoreError(
            f"the database driver for {url.render_as_string(hide_password=True)} is not "
            f"installed: {exc}{hint}"
        ) from None
    except ArgumentError as exc:
        raise StoreError(f"cannot use database URL {url!r}: {exc}") from None
    if backend == "sqlite":
        _configure_sqlite(engine, readonly=readonly)
    return engine


def _configure_sqlite(engine: Engine, *, readonly: bool = False) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: sqlite3.Connection, _record: Any) -> None:
        # Hand transaction control to the "begin" hook below.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
            if readonly:
                return
            cursor.execute("PRAGMA journal_mode = WAL")
            # NORMAL is durable against process crashes in WAL mode (only a power
            # loss can drop the last commits) and much cheaper than FULL.
            cursor.execute("PRAGMA synchronous = NORMAL")
            cursor.execute("PRAGMA foreign_keys = ON")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        if conn.get_execution_options().get(BEGIN_OPTION) == "IMMEDIATE":
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        else:
            conn.exec_driver_sql("BEGIN")


def is_locked_error(exc: BaseException) -> bool:
    """Whether ``exc`` is SQLite's "database is locked/busy" (worth retrying)."""
    if not isinstance(exc, OperationalError):
        return False
    text = str(exc.orig).lower() if exc.orig is not None else str(exc).lower()
    return "database is locked" in text or "database is busy" in text
