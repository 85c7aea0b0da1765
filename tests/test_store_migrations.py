"""Opening databases of other schema revisions, and files that are not databases."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.pool import NullPool

from mxdb.errors import CorruptStoreError, SchemaTooNewError, StoreError
from mxdb.store import Store
from mxdb.store.engine import normalize_url
from mxdb.store.migrate import head_revision, upgrade
from mxdb.store.schema import metadata


def _engine(url: str):  # type: ignore[no-untyped-def]
    return create_engine(normalize_url(url), poolclass=NullPool)


def _index_names(engine, table: str) -> set[str]:  # type: ignore[no-untyped-def]
    # Read the catalogue: SQLAlchemy does not reflect SQLite's expression indexes.
    if engine.dialect.name == "sqlite":
        sql = "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = :t"
    else:
        sql = "SELECT indexname FROM pg_indexes WHERE tablename = :t"
    with engine.connect() as conn:
        return set(conn.execute(text(sql), {"t": table}).scalars())


def test_head_schema_matches_the_table_definitions(db_url: str) -> None:
    with Store.open(db_url):
        pass
    engine = _engine(db_url)
    try:
        insp = inspect(engine)
        for table in metadata.sorted_tables:
            cols = {c["name"] for c in insp.get_columns(table.name)}
            assert cols == {c.name for c in table.columns}, table.name
            assert {ix.name for ix in table.indexes} <= _index_names(engine, table.name)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == (
                head_revision()
            )
    finally:
        engine.dispose()
    assert head_revision() == "0005"


def test_upgrade_from_0001_preserves_data(db_url: str) -> None:
    upgrade(db_url, "0001")
    engine = _engine(db_url)
    try:
        assert "work_points" not in inspect(engine).get_table_names()
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO entries (op, dtype, family, dims, tokens, routing_class, config,"
                    " config_hash, fingerprint_hash, status, source, speedup, created_at) VALUES"
                    " ('fused_moe', 'bf16', 'E8-H1-I1-k2', '{\"tokens\": 4}', 4, 'uniform',"
                    " '{\"block_m\": 16}', 'c4', NULL, 'verified', 'tune', 1.5,"
                    " '2024-01-02 03:04:05')"
                )
            )
            conn.execute(text("UPDATE meta SET value = '5' WHERE key = 'generation'"))
            conn.execute(text("INSERT INTO meta (key, value) VALUES ('policy', 'strict')"))
    finally:
        engine.dispose()

    with Store.open(db_url) as store:
        [e] = store.entries()
        assert (e.tokens, e.config, e.speedup, e.fingerprint_hash) == (
            4,
            {"block_m": 16},
            1.5,
            None,
        )
        assert e.created_at.isoformat() == "2024-01-02T03:04:05+00:00"
        assert store.get_meta("policy") == "strict"
        assert store.generation() == 5
        # The 0002 tables work.
        assert store.add_points("job", [("a", {"x": 1})]) == 1
        claim = store.claim_point("job", "w")
        assert claim is not None and store.complete_point(claim)
        # The natural key (0004's, with the device) still refuses duplicates.
        assert store.add_entries([e])[0] == e.id


def test_upgrade_to_0004_puts_the_device_in_the_natural_key(db_url: str) -> None:
    upgrade(db_url, "0003")
    engine = _engine(db_url)
    insert = (
        "INSERT INTO entries (op, dtype, family, dims, tokens, routing_class, config,"
        " config_hash, fingerprint_hash, device_name, status, source, created_at) VALUES"
        " ('fused_moe', 'bf16', 'E8-I7168', '{}', 1, 'uniform', '{}', 'c1', NULL, :dev,"
        " 'imported', 'vllm', '2024-01-02 03:04:05')"
    )
    try:
        with engine.begin() as conn:
            conn.execute(text(insert), {"dev": "NVIDIA_H100_80GB_HBM3"})
        with pytest.raises(IntegrityError), engine.begin() as conn:
            # 0003: another device's identical row collides
            conn.execute(text(insert), {"dev": "NVIDIA_A100-SXM4-80GB"})
    finally:
        engine.dispose()
    with Store.open(db_url) as store:
        [old] = store.entries()
        other = old.model_copy(update={"id": None, "device_name": "NVIDIA_A100-SXM4-80GB"})
        same = old.model_copy(update={"id": None})
        ids = store.add_entries([other, same])
        assert ids[1] == old.id and ids[0] != old.id
        assert {e.device_name for e in store.entries()} == {
            "NVIDIA_H100_80GB_HBM3",
            "NVIDIA_A100-SXM4-80GB",
        }
    engine = _engine(db_url)
    try:
        assert "uq_entries_natural_key_device" in _index_names(engine, "entries")
        assert "uq_entries_natural_key" not in _index_names(engine, "entries")
    finally:
        engine.dispose()


def test_schema_too_new_refuses_and_changes_nothing(db_url: str) -> None:
    with Store.open(db_url) as store:
        store.add_entries([])
        store.set_meta("k", "v")
    engine = _engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = '9999_future'"))
    finally:
        engine.dispose()
    with pytest.raises(SchemaTooNewError) as info:
        Store.open(db_url)
    msg = str(info.value)
    assert "schema revision 9999_future, newer than this mxdb knows (head 0005)" in msg
    assert "pip install -U mxdb" in msg and "--db" in msg
    assert "database at " in msg
    engine = _engine(db_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == (
                "9999_future"
            )
            assert conn.execute(text("SELECT value FROM meta WHERE key = 'k'")).scalar() == "v"
    finally:
        engine.dispose()


def test_foreign_database_is_refused(db_url: str) -> None:
    engine = _engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)"))
            conn.execute(text("INSERT INTO customers VALUES (1, 'ada')"))
    finally:
        engine.dispose()
    with pytest.raises(StoreError, match="not an mxdb database"):
        Store.open(db_url)
    engine = _engine(db_url)
    try:
        assert inspect(engine).get_table_names() == ["customers"]
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    "content",
    [b"this is a text file, not a database\n" * 10, b"\x00\x01garbage" * 1000, b"SQLite"],
)
def test_corrupt_sqlite_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "notes.sqlite"
    path.write_bytes(content)
    with pytest.raises(CorruptStoreError) as info:
        Store.open(f"sqlite:///{path}")
    msg = str(info.value)
    assert str(path) in msg
    assert "not an SQLite database" in msg and "move the file aside" in msg
    assert path.read_bytes() == content  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.sqlite"]


def test_damaged_sqlite_database(tmp_path: Path) -> None:
    path = tmp_path / "mxdb.sqlite"
    with Store.open(str(path)) as store:
        store.set_meta("k", "v")
    # Keep the header, wreck the rest: SQLite itself must notice.
    data = bytearray(path.read_bytes())
    data[100:] = hashlib.sha256(b"x").digest() * ((len(data) - 100) // 32) + b"\xff" * (
        (len(data) - 100) % 32
    )
    path.write_bytes(bytes(data))
    before = path.read_bytes()
    with pytest.raises(CorruptStoreError, match=str(path)):
        Store.open(str(path))
    assert path.read_bytes() == before


def test_empty_file_is_a_new_database(tmp_path: Path) -> None:
    path = tmp_path / "empty.sqlite"
    path.touch()
    with Store.open(str(path)) as store:
        assert store.generation() == 0
    assert json.dumps(path.stat().st_size > 0) == "true"
