"""The store: mxdb's database (SQLite by default, PostgreSQL too), under Alembic migrations.

``Store.open(url)`` opens and migrates; see ``mxdb.store.store.Store`` for the API.
"""

from mxdb.store.engine import default_url
from mxdb.store.records import Claim, DispatchRow, PointState
from mxdb.store.store import Store

__all__ = ["Claim", "DispatchRow", "PointState", "Store", "default_url"]
