"""Shared fixtures: real databases (a SQLite file, and PostgreSQL when available), the GPU skip.

PostgreSQL runs when ``MXDB_TEST_PG_URL`` names a server (``ci/postgres.sh`` starts one
and prints the URL); every test gets its own freshly created database, dropped after.
Without the variable the PostgreSQL cases are skipped, unless ``MXDB_REQUIRE_PG=1``
(set by CI), which turns a missing or unreachable server into a failure.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL, Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import NullPool

from mxdb.store import Store
from mxdb.store.engine import normalize_url

PG_URL_ENV = "MXDB_TEST_PG_URL"
REQUIRE_PG_ENV = "MXDB_REQUIRE_PG"


def _pg_unavailable(reason: str) -> None:
    if os.environ.get(REQUIRE_PG_ENV) == "1":
        pytest.fail(f"{REQUIRE_PG_ENV}=1 but PostgreSQL is unavailable: {reason}")
    pytest.skip(f"PostgreSQL tests skipped: {reason} (run ci/postgres.sh and set {PG_URL_ENV})")


@pytest.fixture(scope="session")
def pg_admin() -> Iterator[tuple[Engine, URL]]:
    """An AUTOCOMMIT connection engine to the server of $MXDB_TEST_PG_URL."""
    raw = os.environ.get(PG_URL_ENV, "").strip()
    if not raw:
        _pg_unavailable(f"{PG_URL_ENV} is not set")
    url = normalize_url(raw)
    engine = create_engine(url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except SQLAlchemyError as exc:
        engine.dispose()
        _pg_unavailable(f"cannot connect to {url.render_as_string(hide_password=True)}: {exc}")
    yield engine, url
    engine.dispose()


def _fresh_pg_database(admin: tuple[Engine, URL]) -> Iterator[str]:
    engine, url = admin
    name = f"mxdb_test_{uuid.uuid4().hex[:12]}"
    with engine.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield url.set(database=name).render_as_string(hide_password=False)
    finally:
        with engine.connect() as conn:
            # FORCE: a test may leave (or kill) clients behind.
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[str]:
    """The URL of an empty database: a SQLite file in tmp_path, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'mxdb.sqlite'}"
    else:
        yield from _fresh_pg_database(request.getfixturevalue("pg_admin"))


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    """An opened (migrated) store on ``db_url``."""
    with Store.open(db_url) as opened:
        yield opened


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``gpu`` unless torch is installed and sees a CUDA device.

    torch is imported only here, and only when a gpu test was collected: the core
    test suite must run (and prove mxdb imports no torch) without it.
    """
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = ""
    if importlib.util.find_spec("torch") is None:
        reason = "torch is not installed"
    else:
        try:
            import torch

            if not torch.cuda.is_available():
                reason = "torch sees no CUDA device"
        except Exception as exc:  # a broken torch install is a reason to skip, not crash
            reason = f"torch cannot be imported: {exc}"
    if reason:
        marker = pytest.mark.skip(reason=f"GPU test skipped: {reason}")
        for item in gpu_items:
            item.add_marker(marker)


@pytest.fixture(scope="module")
def cuda_torch() -> Any:
    """torch, for GPU tests of FlagGems' and mxdb's kernels (skips without CUDA or flag_gems)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("flag_gems")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch
