"""The store: verified configs, measurements, fingerprints and tuning work, in one database.

SQLite (the default, a file in the user's cache directory) or PostgreSQL, through
the same code.  Every method is one transaction.  Writes to ``entries`` bump the
generation counter in the same transaction; the dispatcher polls ``generation()``
to know when to reload.
"""

from __future__ import annotations

import json
import os
import stat
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar, get_args

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Engine,
    Text,
    and_,
    cast,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DatabaseError, SQLAlchemyError

from mxdb.errors import (
    CorruptStoreError,
    InvalidInputError,
    MxdbError,
    NotFoundError,
    StoreError,
    StoreNotFoundError,
)
from mxdb.models import DECIDED_STATUSES, Entry, EntryStatus, Fingerprint, Measurement, utcnow
from mxdb.store import schema
from mxdb.store.engine import (
    BEGIN_OPTION,
    default_url,
    is_locked_error,
    make_engine,
    normalize_url,
    sqlite_path,
)
from mxdb.store.migrate import ensure_schema
from mxdb.store.records import Claim, DispatchRow, PointState
from mxdb.store.schema import GENERATION_KEY, NATURAL_KEY_DEVICE, NATURAL_KEY_FP

entries_t = schema.entries
fingerprints_t = schema.fingerprints
measurements_t = schema.measurements
meta_t = schema.meta
points_t = schema.work_points

T = TypeVar("T")

_SQLITE_HEADER = b"SQLite format 3\x00"
#: Retries of a SQLite write that still hit "database is locked" after busy_timeout.
_LOCKED_RETRIES = 5
#: Rows per IN (...) list, well under SQLite's bound-parameter limit.
_CHUNK = 500
ENTRY_STATUSES: tuple[str, ...] = get_args(EntryStatus)
POINT_STATES = ("pending", "claimed", "done")


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _chunks(items: Sequence[T], size: int = _CHUNK) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


# The dispatcher's first lookup of a family, as plain SQL run on the DBAPI cursor
# ("?" becomes the driver's placeholder).  Column order is DispatchRow's.
_FAMILY_SQL = (
    "SELECT id, tokens, routing_class, config_hash, fingerprint_hash, status, speedup "
    "FROM entries WHERE op = ? AND dtype = ? AND family = ?"
)
_CONFIG_SQL = "SELECT config FROM entries WHERE id = ?"
_BUMP_GENERATION = (
    update(meta_t)
    .where(meta_t.c.key == GENERATION_KEY)
    .values(value=cast(cast(meta_t.c.value, BigInteger) + 1, Text))
)
_NATURAL_KEY = (
    entries_t.c.op,
    entries_t.c.dtype,
    entries_t.c.family,
    entries_t.c.tokens,
    entries_t.c.routing_class,
    NATURAL_KEY_FP,
    NATURAL_KEY_DEVICE,
    entries_t.c.source,
    entries_t.c.config_hash,
)


def _entry_values(entry: Entry) -> dict[str, Any]:
    data = entry.model_dump(exclude={"id"})
    data["job"] = entry.job  # not serialized (see Entry.job), but stored
    data["dims"] = _dumps(data["dims"])
    data["config"] = _dumps(data["config"])
    data["validation"] = None if data["validation"] is None else _dumps(data["validation"])
    return data


def _entry_from_row(row: Any) -> Entry:
    data = dict(row._mapping)
    data["dims"] = json.loads(data["dims"])
    data["config"] = json.loads(data["config"])
    if data.get("validation") is not None:
        data["validation"] = json.loads(data["validation"])
    return Entry.model_validate(data)


def _measurement_values(m: Measurement) -> dict[str, Any]:
    data = m.model_dump(exclude={"id"})
    data["dims"] = _dumps(data["dims"])
    data["config"] = _dumps(data["config"])
    data["samples_us"] = _dumps(data["samples_us"])
    return data


def _measurement_from_row(row: Any) -> Measurement:
    data = dict(row._mapping)
    data["dims"] = json.loads(data["dims"])
    data["config"] = json.loads(data["config"])
    data["samples_us"] = json.loads(data["samples_us"])
    return Measurement.model_validate(data)


def _natural_key(values: dict[str, Any]) -> tuple[Any, ...]:
    return (
        values["op"],
        values["dtype"],
        values["family"],
        values["tokens"],
        values["routing_class"],
        values["fingerprint_hash"] or "",
        values["device_name"] or "",
        values["source"],
        values["config_hash"],
    )


def _entry_conds(
    op: str | None,
    dtype: str | None,
    family: str | None,
    status: str | Sequence[str] | None,
    fingerprint_hash: str | None,
    source: str | None,
    job: str | None = None,
) -> list[ColumnElement[bool]]:
    """The WHERE conditions of an entries filter (None means any)."""
    conds: list[ColumnElement[bool]] = []
    for column, value in (
        (entries_t.c.op, op),
        (entries_t.c.dtype, dtype),
        (entries_t.c.family, family),
        (entries_t.c.fingerprint_hash, fingerprint_hash),
        (entries_t.c.source, source),
        (entries_t.c.job, job),
    ):
        if value is not None:
            conds.append(column == value)
    if isinstance(status, str):
        conds.append(entries_t.c.status == status)
    elif status is not None:
        conds.append(entries_t.c.status.in_(list(status)))
    return conds


def _check_sqlite_file(path: Path) -> None:
    """Refuse a path that is not a SQLite database, before SQLite touches it."""
    if path.is_dir():
        raise StoreError(f"{path} is a directory, not a database file; pass a file path as --db")
    try:
        st = path.stat()
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise StoreError(
            f"{path} is not a regular file (a FIFO, socket or device), so not a database; "
            "pass a database file as --db"
        )
    size = st.st_size
    if size == 0:
        return  # an empty file is an empty database
    with path.open("rb") as fh:
        header = fh.read(len(_SQLITE_HEADER))
    if header != _SQLITE_HEADER:
        raise CorruptStoreError(
            f"{path} is not an SQLite database (it does not start with the SQLite header); "
            "nothing was changed: move the file aside, or point --db / MXDB_DB at another file"
        )


def _overflow(what: str) -> InvalidInputError:
    return InvalidInputError(
        f"{what}: a number is too large for the database (integers are limited to 2**63 - 1); "
        "check the input's values"
    )


def _writable(path: Path) -> bool:
    """Whether this process may write the SQLite file (and create its journal beside it)."""
    return os.access(path, os.W_OK)


def _require_schema(engine: Engine, display: str, *, readonly: bool) -> None:
    """For a store opened to read: it must already hold mxdb's schema (at head, if read-only)."""
    from mxdb.store.migrate import _check, head_revision

    with engine.connect() as conn, conn.begin():
        current = _check(conn, display)
    if not current:
        raise StoreNotFoundError(
            f"the database at {display} holds no mxdb store; commands that only read never "
            "create one: check --db / MXDB_DB, or create the store with `mxdb import` or "
            "`mxdb tune`"
        )
    if readonly and current != (head_revision(),):
        raise StoreError(
            f"the read-only store at {display} has schema revision {', '.join(current)}, older "
            f"than this mxdb's {head_revision()}; open it once with write access to upgrade it"
        )


class Store:
    """An open database.  Use ``Store.open(url)``; close it (or use it as a context manager)."""

    def __init__(self, engine: Engine, display_url: str) -> None:
        self._engine = engine
        self.url = display_url
        self.dialect: str = engine.dialect.name
        self._sqlite = self.dialect == "sqlite"
        self._writer = engine.execution_options(**{BEGIN_OPTION: "IMMEDIATE"})
        placeholder = "?" if engine.dialect.paramstyle == "qmark" else "%s"
        self._family_sql = _FAMILY_SQL.replace("?", placeholder)
        self._generation_sql = "SELECT value FROM meta WHERE key = ?".replace("?", placeholder)
        self._config_sql = _CONFIG_SQL.replace("?", placeholder)

    # -- opening and closing -------------------------------------------------------

    @classmethod
    def open(cls, url: str | None = None, *, create: bool = True) -> Store:
        """Open (and migrate to the newest schema) the database at ``url`` or ``default_url()``.

        ``create=False`` (commands that only read): a SQLite file that does not exist, or a
        database without mxdb's schema, is a ``StoreNotFoundError``; nothing is created.
        A SQLite file this process cannot write is opened read-only: reads work, writes
        fail with a ``StoreError`` that says so.
        """
        parsed = normalize_url(url if url is not None else default_url())
        display = parsed.render_as_string(hide_password=True)
        path = sqlite_path(parsed)
        readonly = False
        if path is not None:
            _check_sqlite_file(path)
            if not create and not path.exists():
                raise StoreNotFoundError(
                    f"there is no store at {display} ({path} does not exist); commands that "
                    "only read never create one: check --db / MXDB_DB, or create the store "
                    "with `mxdb import` or `mxdb tune`"
                )
            readonly = path.exists() and not _writable(path)
            if not readonly:
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                except OSError as exc:
                    raise StoreError(
                        f"cannot create the directory of database {path}: {exc}; "
                        "choose another --db / MXDB_DB"
                    ) from None
        engine = make_engine(parsed, readonly=readonly)
        try:
            for attempt in range(_LOCKED_RETRIES + 1):
                try:
                    if readonly or not create:
                        _require_schema(engine, display, readonly=readonly)
                    if not readonly:
                        ensure_schema(engine, display)
                    break
                except DatabaseError as exc:
                    # A fresh SQLite file opened by several processes at once: switching it to
                    # WAL can report "locked" without waiting on busy_timeout; retry as the
                    # writes do.
                    if path is None or not is_locked_error(exc) or attempt == _LOCKED_RETRIES:
                        raise
                    time.sleep(0.05 * 2**attempt)
        except MxdbError:
            engine.dispose()
            raise
        except DatabaseError as exc:
            engine.dispose()
            reason = str(exc.orig) if exc.orig is not None else str(exc)
            if path is not None and ("not a database" in reason or "malformed" in reason):
                raise CorruptStoreError(
                    f"{path} is not a usable SQLite database ({reason}); nothing was changed: "
                    "move the file aside, or point --db / MXDB_DB at another file"
                ) from None
            raise StoreError(
                f"cannot open the database at {display}: {reason}; check that it is reachable "
                "and writable, or use another --db"
            ) from None
        except SQLAlchemyError as exc:
            engine.dispose()
            raise StoreError(f"cannot open the database at {display}: {exc}") from None
        return cls(engine, display)

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    # -- transactions -------------------------------------------------------------

    def _fail(self, what: str, exc: SQLAlchemyError) -> StoreError:
        reason = str(getattr(exc, "orig", None) or exc).strip()
        if "readonly database" in reason or "read-only" in reason:
            return StoreError(
                f"{what} failed on {self.url}: the store is read-only here ({reason}); "
                "commands that write need write access to it (or use another --db)"
            )
        return StoreError(f"{what} failed on {self.url}: {reason}")

    @contextmanager
    def _read(self, what: str) -> Iterator[Connection]:
        try:
            with self._engine.connect() as conn, conn.begin():
                yield conn
        except SQLAlchemyError as exc:
            if isinstance(exc.__cause__, OverflowError) or "too large" in str(exc):
                raise _overflow(what) from None
            raise self._fail(what, exc) from exc
        except OverflowError:
            raise _overflow(what) from None

    def _write(self, what: str, fn: Callable[[Connection], T]) -> T:
        """Run ``fn`` in one write transaction (BEGIN IMMEDIATE on SQLite), retrying locks."""
        for attempt in range(_LOCKED_RETRIES + 1):
            try:
                with self._writer.connect() as conn, conn.begin():
                    return fn(conn)
            except OverflowError:
                raise _overflow(what) from None
            except SQLAlchemyError as exc:
                if self._sqlite and is_locked_error(exc) and attempt < _LOCKED_RETRIES:
                    time.sleep(0.05 * 2**attempt)
                    continue
                if isinstance(exc.__cause__, OverflowError) or "too large to convert" in str(exc):
                    raise _overflow(what) from None
                raise self._fail(what, exc) from exc
        raise AssertionError("unreachable")

    def _insert(self, table: Any) -> Any:
        """The dialect's INSERT (both have ``on_conflict_do_nothing/update``)."""
        module = sqlite_dialect if self._sqlite else pg_dialect
        return module.insert(table)

    # -- meta -----------------------------------------------------------------------

    def generation(self) -> int:
        """A counter bumped by every write to entries: poll it to know when to reload."""
        rows = self._fetch_raw("reading the generation", self._generation_sql, (GENERATION_KEY,))
        if not rows:
            raise CorruptStoreError(
                f"the store at {self.url} has no generation counter in its meta table; "
                "it was altered outside mxdb: restore it from a backup or use another --db"
            )
        return int(rows[0][0])

    def revision(self) -> str:
        """The schema revision stamped in the database (Alembic), e.g. ``"0003"``."""
        from mxdb.store.migrate import current_revisions

        with self._read("reading the schema revision") as conn:
            return ", ".join(current_revisions(conn)) or "none"

    def get_meta(self, key: str) -> str | None:
        with self._read("reading meta") as conn:
            value = conn.execute(select(meta_t.c.value).where(meta_t.c.key == key)).scalar()
        return None if value is None else str(value)

    def set_meta(self, key: str, value: str) -> None:
        if key == GENERATION_KEY:
            raise InvalidInputError(
                f"meta key {key!r} is the store's own counter and cannot be set; use another key"
            )

        def fn(conn: Connection) -> None:
            stmt = self._insert(meta_t).values(key=key, value=value)
            conn.execute(stmt.on_conflict_do_update(index_elements=["key"], set_={"value": value}))

        self._write("writing meta", fn)

    # -- fingerprints -----------------------------------------------------------------

    def put_fingerprint(self, fp: Fingerprint) -> str:
        """Store ``fp`` (idempotent); returns its hash."""
        self._write("storing a fingerprint", lambda conn: self._put_fingerprint(conn, fp))
        return fp.hash

    def _put_fingerprint(self, conn: Connection, fp: Fingerprint) -> None:
        stmt = self._insert(fingerprints_t).values(
            hash=fp.hash, components=_dumps(fp.components()), created_at=utcnow()
        )
        conn.execute(stmt.on_conflict_do_nothing(index_elements=["hash"]))

    def get_fingerprint(self, h: str) -> Fingerprint | None:
        with self._read("reading a fingerprint") as conn:
            text = conn.execute(
                select(fingerprints_t.c.components).where(fingerprints_t.c.hash == h)
            ).scalar()
        return None if text is None else Fingerprint.model_validate(json.loads(text))

    def fingerprints(self) -> dict[str, Fingerprint]:
        with self._read("reading fingerprints") as conn:
            rows = conn.execute(
                select(fingerprints_t.c.hash, fingerprints_t.c.components).order_by(
                    fingerprints_t.c.hash
                )
            ).all()
        return {h: Fingerprint.model_validate(json.loads(c)) for h, c in rows}

    # -- entries -----------------------------------------------------------------------

    def _bump(self, conn: Connection) -> None:
        conn.execute(_BUMP_GENERATION)

    def _add_entries(self, conn: Connection, entries: Sequence[Entry]) -> list[int]:
        if not entries:
            return []
        # First statement of the transaction: on PostgreSQL, the generation row lock
        # serializes writers of entries in one order, so they cannot deadlock.
        self._bump(conn)
        values = [_entry_values(e) for e in entries]
        stmt = self._insert(entries_t).on_conflict_do_nothing(index_elements=list(_NATURAL_KEY))
        conn.execute(stmt, values)
        # Ids of new and pre-existing rows alike, by natural key.
        ids: dict[tuple[Any, ...], int] = {}
        groups: dict[tuple[str, str, str], set[int]] = {}
        for v in values:
            groups.setdefault((v["op"], v["dtype"], v["family"]), set()).add(v["tokens"])
        for (op, dtype, family), tokens in groups.items():
            token_list = sorted(tokens)
            for part in _chunks(token_list):
                rows = conn.execute(
                    select(entries_t.c.id, *_NATURAL_KEY).where(
                        entries_t.c.op == op,
                        entries_t.c.dtype == dtype,
                        entries_t.c.family == family,
                        entries_t.c.tokens.in_(part),
                    )
                ).all()
                for row in rows:
                    ids[tuple(row[1:])] = row[0]
        return [ids[_natural_key(v)] for v in values]

    def add_entries(
        self, entries: Sequence[Entry], *, fingerprints: Sequence[Fingerprint] = ()
    ) -> list[int]:
        """Add ``entries`` (and the ``fingerprints`` they name) in one transaction.

        Returns the entries' ids, in order.  An entry whose natural key (op, dtype, family,
        tokens, routing_class, fingerprint_hash, device_name, source, config_hash) is already
        stored is skipped and the stored row's id returned.  Bumps the generation.  A writer
        killed mid-way leaves neither the fingerprints nor the entries behind.
        """
        entries = list(entries)
        fps = list(fingerprints)

        def fn(conn: Connection) -> list[int]:
            for fp in fps:
                self._put_fingerprint(conn, fp)
            return self._add_entries(conn, entries)

        return self._write("adding entries", fn)

    def entries(
        self,
        *,
        op: str | None = None,
        dtype: str | None = None,
        family: str | None = None,
        status: str | Sequence[str] | None = None,
        fingerprint_hash: str | None = None,
        source: str | None = None,
        job: str | None = None,
    ) -> list[Entry]:
        """Entries matching every given filter, by id (``job``: the tuning job's rows)."""
        conds = _entry_conds(op, dtype, family, status, fingerprint_hash, source, job)
        with self._read("reading entries") as conn:
            rows = conn.execute(select(entries_t).where(*conds).order_by(entries_t.c.id)).all()
        return [_entry_from_row(r) for r in rows]

    def count_entries(
        self,
        *,
        op: str | None = None,
        dtype: str | None = None,
        family: str | None = None,
        status: str | Sequence[str] | None = None,
        fingerprint_hash: str | None = None,
        source: str | None = None,
    ) -> dict[str, int]:
        """How many entries match every given filter, by status (one query, no rows read)."""
        conds = _entry_conds(op, dtype, family, status, fingerprint_hash, source)
        query = select(entries_t.c.status, func.count()).where(*conds).group_by(entries_t.c.status)
        with self._read("counting entries") as conn:
            return {str(st): int(n) for st, n in conn.execute(query).all()}

    def get_entry(self, id: int) -> Entry:
        with self._read("reading an entry") as conn:
            row = conn.execute(select(entries_t).where(entries_t.c.id == id)).first()
        if row is None:
            raise NotFoundError(
                f"entry {id} is not in the store at {self.url}; list entries to find its id"
            )
        return _entry_from_row(row)

    def set_status(self, ids: Sequence[int], status: str, reason: str | None = None) -> int:
        """Set the status (and stale_reason) of the entries ``ids``; returns how many changed.

        Bumps the generation.
        """
        if status not in ENTRY_STATUSES:
            raise InvalidInputError(
                f"entry status {status!r} is not valid; use one of {', '.join(ENTRY_STATUSES)}"
            )
        id_list = sorted({int(i) for i in ids})
        if not id_list:
            return 0

        def fn(conn: Connection) -> int:
            self._bump(conn)
            changed = 0
            for part in _chunks(id_list):
                result = conn.execute(
                    update(entries_t)
                    .where(entries_t.c.id.in_(part))
                    .values(status=status, stale_reason=reason)
                )
                changed += result.rowcount
            return changed

        return self._write("setting entry status", fn)

    def family_rows(self, op: str, dtype: str, family: str) -> list[DispatchRow]:
        """Every entry of one (op, dtype, family), any status, as light rows (no order).

        The dispatcher's first lookup of a family, answered from a covering index: see
        ``_fetch_raw``.
        """
        rows = self._fetch_raw("reading a family", self._family_sql, (op, dtype, family))
        return list(map(DispatchRow._make, rows))

    def entry_validation(self, id: int) -> tuple[float | None, list[dict[str, Any]] | None]:
        """Entry ``id``'s confidence and held-out validation record (None, None if absent).

        Read by the dispatcher only when it considers answering a neighbouring key from the
        entry, never on the hot path.  A record that is not valid JSON reads as absent.
        """
        rows = self._fetch_raw(
            "reading an entry's validation",
            self._config_sql.replace("SELECT config", "SELECT confidence, validation"),
            (id,),
        )
        if not rows:
            return None, None
        confidence, text = rows[0]
        try:
            record = json.loads(text) if text else None
        except ValueError:
            record = None
        if not isinstance(record, list):
            record = None
        return (float(confidence) if confidence is not None else None), record

    def entry_config(self, id: int) -> str:
        """The config JSON text of entry ``id`` (NotFoundError if there is none)."""
        rows = self._fetch_raw("reading an entry's config", self._config_sql, (id,))
        if not rows:
            raise NotFoundError(f"no entry with id {id} in {self.url}")
        return str(rows[0][0])

    def _fetch_raw(self, what: str, sql: str, params: tuple[Any, ...]) -> list[Any]:
        """Run a fixed SQL string on a pooled DBAPI connection and return its rows.

        For the dispatcher's hot reads: SQLAlchemy's statement and result layers cost
        about 40 us a call plus 2 us a row, the budget is 200 us.
        """
        try:
            raw = self._engine.raw_connection()
        except SQLAlchemyError as exc:
            raise self._fail(what, exc) from exc
        try:
            if self._sqlite:
                cursor = raw.cursor()
            else:
                # Autocommit for this one statement: no BEGIN, and no ROLLBACK round trip
                # when the connection goes back to the pool.
                raw.driver_connection.autocommit = True  # type: ignore[union-attr]
                cursor = raw.cursor()
            try:
                cursor.execute(sql, params)
                return list(cursor.fetchall())
            finally:
                cursor.close()
                if not self._sqlite:
                    raw.driver_connection.autocommit = False  # type: ignore[union-attr]
        except Exception as exc:
            raw.invalidate()
            raise StoreError(f"{what} failed on {self.url}: {exc}") from exc
        finally:
            raw.close()

    # -- measurements -----------------------------------------------------------------

    def _add_measurements(self, conn: Connection, ms: Sequence[Measurement]) -> list[int]:
        if not ms:
            return []
        values = [_measurement_values(m) for m in ms]
        stmt = self._insert(measurements_t).on_conflict_do_nothing(index_elements=["run_id"])
        conn.execute(stmt, values)
        ids: dict[str, int] = {}
        run_ids = [v["run_id"] for v in values]
        for part in _chunks(run_ids):
            rows = conn.execute(
                select(measurements_t.c.run_id, measurements_t.c.id).where(
                    measurements_t.c.run_id.in_(part)
                )
            ).all()
            ids.update({r[0]: r[1] for r in rows})
        return [ids[r] for r in run_ids]

    def add_measurements(self, ms: Sequence[Measurement]) -> list[int]:
        """Add measurements in one transaction; returns their ids, in order.

        ``run_id`` is unique: a measurement whose run_id is stored already is skipped
        and the stored row's id returned.
        """
        ms = list(ms)
        return self._write("adding measurements", lambda conn: self._add_measurements(conn, ms))

    def measurements(
        self,
        *,
        op: str | None = None,
        family: str | None = None,
        tokens: int | None = None,
        status: str | None = None,
        run_id: str | None = None,
        job: str | None = None,
    ) -> list[Measurement]:
        """Measurements matching every given filter, by id (``job``: the tuning job's rows)."""
        conds: list[ColumnElement[bool]] = []
        for column, value in (
            (measurements_t.c.op, op),
            (measurements_t.c.family, family),
            (measurements_t.c.tokens, tokens),
            (measurements_t.c.status, status),
            (measurements_t.c.run_id, run_id),
            (measurements_t.c.job, job),
        ):
            if value is not None:
                conds.append(column == value)
        with self._read("reading measurements") as conn:
            rows = conn.execute(
                select(measurements_t).where(*conds).order_by(measurements_t.c.id)
            ).all()
        return [_measurement_from_row(r) for r in rows]

    # -- work claiming -------------------------------------------------------------------

    def add_points(self, job: str, points: Sequence[tuple[str, dict[str, Any]]]) -> int:
        """Add the points (key, payload) of ``job`` as pending; existing keys are left alone.

        Returns how many points were new.
        """
        now = utcnow()
        values = [
            {
                "job": job,
                "key": key,
                "payload": _dumps(payload),
                "state": "pending",
                "worker": None,
                "token": None,
                "expires_at": None,
                "attempts": 0,
                "updated_at": now,
            }
            for key, payload in points
        ]
        count = select(func.count()).select_from(points_t).where(points_t.c.job == job)

        def fn(conn: Connection) -> int:
            if not values:
                return 0
            before = conn.execute(count).scalar_one()
            stmt = self._insert(points_t).on_conflict_do_nothing(index_elements=["job", "key"])
            conn.execute(stmt, values)
            return int(conn.execute(count).scalar_one() - before)

        return self._write("adding work points", fn)

    def claim_point(self, job: str, worker: str, lease_s: float = 600) -> Claim | None:
        """Claim a pending point of ``job``, or one whose claim expired; None if there is none.

        The claim lasts ``lease_s`` seconds unless renewed; attempts is incremented.
        """
        token = uuid.uuid4().hex

        def fn(conn: Connection) -> Claim | None:
            now = utcnow()
            # PostgreSQL: rows other claimers hold are skipped, not waited on.
            # SQLite: BEGIN IMMEDIATE already serializes claimers (FOR UPDATE is not rendered).
            row = conn.execute(
                select(points_t.c.key, points_t.c.payload)
                .where(
                    points_t.c.job == job,
                    or_(
                        points_t.c.state == "pending",
                        and_(points_t.c.state == "claimed", points_t.c.expires_at < now),
                    ),
                )
                .order_by(points_t.c.key)
                .limit(1)
                .with_for_update(skip_locked=True)
            ).first()
            if row is None:
                return None
            expires = now + timedelta(seconds=lease_s)
            conn.execute(
                update(points_t)
                .where(points_t.c.job == job, points_t.c.key == row.key)
                .values(
                    state="claimed",
                    worker=worker,
                    token=token,
                    expires_at=expires,
                    attempts=points_t.c.attempts + 1,
                    updated_at=now,
                )
            )
            return Claim(job, row.key, json.loads(row.payload), worker, token, expires)

        return self._write("claiming a work point", fn)

    def _held(self, claim: Claim) -> ColumnElement[bool]:
        return and_(
            points_t.c.job == claim.job,
            points_t.c.key == claim.key,
            points_t.c.token == claim.token,
            points_t.c.state == "claimed",
        )

    def renew_claim(self, claim: Claim, lease_s: float) -> bool:
        """Extend ``claim`` to ``lease_s`` seconds from now; False if it was lost."""

        def fn(conn: Connection) -> bool:
            now = utcnow()
            result = conn.execute(
                update(points_t)
                .where(self._held(claim))
                .values(expires_at=now + timedelta(seconds=lease_s), updated_at=now)
            )
            return result.rowcount == 1

        return self._write("renewing a claim", fn)

    def complete_point(
        self,
        claim: Claim,
        *,
        entries: Sequence[Entry] = (),
        measurements: Sequence[Measurement] = (),
        rejections: Sequence[tuple[int, str]] = (),
    ) -> bool:
        """Write the point's results and mark it done, in one transaction.

        An entry whose natural key is already stored (another point decided the same key and
        config: another trace, another job) is not written again: the stored row, with the
        evidence of the point that first decided it, stands for both (``mxdb.tune.runner``
        exports it in the bundles of every point that decided it).

        ``rejections`` are ``(entry id, reason)`` of dispatchable entries (verified, baseline or
        parity) the point's measurements contradict or supersede: they become ``rejected`` in
        the same transaction.  Returns False, writing
        nothing, if the claim was lost (another worker took the point after the lease expired,
        or it is done).  A claim whose lease expired but that nobody took yet still completes.
        """
        entries = list(entries)
        measurements = list(measurements)
        rejections = list(rejections)

        def fn(conn: Connection) -> bool:
            held = conn.execute(
                select(points_t.c.key).where(self._held(claim)).with_for_update()
            ).first()
            if held is None:
                return False
            self._add_measurements(conn, measurements)
            self._add_entries(conn, entries)
            if rejections:
                self._bump(conn)
            for entry_id, reason in rejections:
                conn.execute(
                    update(entries_t)
                    .where(
                        entries_t.c.id == int(entry_id),
                        entries_t.c.status.in_(DECIDED_STATUSES),
                    )
                    .values(status="rejected", stale_reason=reason)
                )
            conn.execute(
                update(points_t)
                .where(self._held(claim))
                .values(state="done", expires_at=None, updated_at=utcnow())
            )
            return True

        return self._write("completing a work point", fn)

    def point_payloads(self, job: str) -> list[tuple[str, dict[str, Any]]]:
        """Every point of ``job`` with its payload, by key."""
        with self._read("reading work points") as conn:
            rows = conn.execute(
                select(points_t.c.key, points_t.c.payload)
                .where(points_t.c.job == job)
                .order_by(points_t.c.key)
            ).all()
        return [(str(r[0]), json.loads(r[1])) for r in rows]

    def points(self, job: str) -> list[PointState]:
        """Every point of ``job``, by key."""
        with self._read("reading work points") as conn:
            rows = conn.execute(
                select(
                    points_t.c.key,
                    points_t.c.state,
                    points_t.c.worker,
                    points_t.c.attempts,
                    points_t.c.expires_at,
                )
                .where(points_t.c.job == job)
                .order_by(points_t.c.key)
            ).all()
        return [PointState(r[0], r[1], r[2], r[3], r[4]) for r in rows]
