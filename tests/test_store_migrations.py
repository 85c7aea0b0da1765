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
    assert head_revision() == "0006"


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
    assert "schema revision 9999_future, newer than this mxdb knows (head 0006)" in msg
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


def test_a_migration_committed_between_the_checks_reads_is_not_a_foreign_database(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside the migration lock a concurrent opener's migration can commit between the
    check's read of the schema stamp and its read of the tables (PostgreSQL, read committed):
    the tables are then visible while the first read saw no stamp.  That is an mxdb
    database being created, not a foreign one."""
    import mxdb.store.migrate as migrate

    Store.open(db_url).close()  # the "other opener" has migrated
    real = migrate.current_revisions
    reads: list[tuple[str, ...]] = []

    def first_read_before_the_commit(conn: object) -> tuple[str, ...]:
        got = () if not reads else real(conn)  # type: ignore[arg-type]
        reads.append(got)
        return got

    monkeypatch.setattr(migrate, "current_revisions", first_read_before_the_commit)
    Store.open(db_url).close()
    assert reads[0] == () and reads[1] == (head_revision(),)


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


def _tag(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def test_upgrade_to_0006_backfills_the_job_column(db_url: str) -> None:
    """Rows at 0005 get the job their run id (measurements) or evidence (entries) names by the
    tuner's prefix convention, when exactly one job in work_points has that prefix."""
    upgrade(db_url, "0005")
    job_a, job_b = "wl-aaaa-ffff", "wl-bbbb-ffff"
    key_a, key_b = "E8-H1-I1-k2:4:bf16:uniform", "E8-H1-I1-k2:8:bf16:uniform"
    pa = f"{_tag(job_a)}-{_tag(key_a)}-"
    pb = f"{_tag(job_b)}-{_tag(key_b)}-"
    other_key = f"{_tag(job_a)}-{_tag('no such point')}-"  # job A's tag, a key it lacks
    unknown = f"{_tag('a job with no points')}-{_tag(key_a)}-"
    measurement = (
        "INSERT INTO measurements (run_id, op, dtype, family, dims, tokens, routing_class,"
        " config, config_hash, role, fidelity, status, samples_us, created_at) VALUES"
        " (:rid, 'fused_moe', 'bf16', 'E8-H1-I1-k2', '{}', 4, 'uniform', '{}', 'c', 'candidate',"
        " 'replay', 'ok', '[]', '2024-01-02 03:04:05')"
    )
    entry = (
        "INSERT INTO entries (op, dtype, family, dims, tokens, routing_class, config,"
        " config_hash, status, source, evidence, created_at) VALUES"
        " ('fused_moe', 'bf16', 'E8-H1-I1-k2', '{\"tokens\": 4}', 4, 'uniform', '{}', :c,"
        " 'verified', :src, :ev, '2024-01-02 03:04:05')"
    )
    point = (
        "INSERT INTO work_points (job, key, payload, state, attempts, updated_at) VALUES"
        " (:job, :key, '{}', 'done', 1, '2024-01-02 03:04:05')"
    )
    engine = _engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(text(point), [{"job": job_a, "key": key_a}, {"job": job_b, "key": key_b}])
            conn.execute(
                text(measurement),
                [
                    {"rid": pa + "0a0b0c-c00001"},
                    {"rid": pb + "0d0e0f-c00001"},
                    {"rid": other_key + "0a0b0c-c00002"},
                    {"rid": unknown + "0a0b0c-c00003"},
                    {"rid": "hand-written-run"},
                ],
            )
            conn.execute(
                text(entry),
                [
                    {"c": "c1", "src": "tune", "ev": pa + "0a0b0c-c00001"},
                    {"c": "c2", "src": "tune", "ev": pb + "0d0e0f-c00001"},
                    {"c": "c3", "src": "tune", "ev": unknown + "0a0b0c-c00003"},
                    {"c": "c4", "src": "vllm", "ev": None},
                    {"c": "c5", "src": "mxdb-import", "ev": "evidence/some-bundle"},
                ],
            )
    finally:
        engine.dispose()

    with Store.open(db_url) as store:
        jobs = {m.run_id: m.job for m in store.measurements()}
        assert jobs == {
            pa + "0a0b0c-c00001": job_a,
            pb + "0d0e0f-c00001": job_b,
            other_key + "0a0b0c-c00002": None,
            unknown + "0a0b0c-c00003": None,
            "hand-written-run": None,
        }
        assert {e.config_hash: e.job for e in store.entries()} == {
            "c1": job_a,
            "c2": job_b,
            "c3": None,
            "c4": None,
            "c5": None,
        }
        assert [m.run_id for m in store.measurements(job=job_a)] == [pa + "0a0b0c-c00001"]
        assert [e.config_hash for e in store.entries(job=job_b)] == ["c2"]
    engine = _engine(db_url)
    try:
        assert "ix_entries_job" in _index_names(engine, "entries")
        assert "ix_measurements_job" in _index_names(engine, "measurements")
        # 0004's expression index survives the upgrade
        assert "uq_entries_natural_key_device" in _index_names(engine, "entries")
    finally:
        engine.dispose()


def test_upgrade_to_0006_leaves_colliding_job_tags_unclaimed(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two jobs whose tags collide: neither claims a row by prefix (ambiguous)."""
    from mxdb.store.migrate import script_directory

    # the module Alembic runs (it loads the script itself)
    migration = script_directory().get_revision("0006").module
    monkeypatch.setattr(migration, "_tag", lambda s: "00000000")
    upgrade(db_url, "0005")
    engine = _engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO work_points (job, key, payload, state, attempts, updated_at)"
                    " VALUES (:job, 'k', '{}', 'done', 1, '2024-01-02 03:04:05')"
                ),
                [{"job": "job-1"}, {"job": "job-2"}],
            )
            conn.execute(
                text(
                    "INSERT INTO measurements (run_id, op, dtype, family, dims, tokens,"
                    " routing_class, config, config_hash, role, fidelity, status, samples_us,"
                    " created_at) VALUES ('00000000-00000000-0a0b0c-c1', 'fused_moe', 'bf16',"
                    " 'E8-H1-I1-k2', '{}', 4, 'uniform', '{}', 'c', 'candidate', 'replay', 'ok',"
                    " '[]', '2024-01-02 03:04:05')"
                )
            )
    finally:
        engine.dispose()
    with Store.open(db_url) as store:
        [m] = store.measurements()
        assert m.job is None
