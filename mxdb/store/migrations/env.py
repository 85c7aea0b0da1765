"""Alembic environment for the store: migrations run only online, on a connection mxdb opened.

``mxdb.store.migrate`` passes the connection (already inside a transaction that
holds the database's write lock) in ``config.attributes["connection"]``.
"""

from __future__ import annotations

from alembic import context

config = context.config
connection = config.attributes.get("connection")
if connection is None or context.is_offline_mode():
    raise RuntimeError(
        "mxdb migrations run only through mxdb (Store.open or mxdb.store.migrate.upgrade), "
        "not from the alembic command line"
    )

# render_as_batch: SQLite cannot ALTER most things; batch mode recreates tables instead.
context.configure(connection=connection, target_metadata=None, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
