"""mxdb.store.migrations."""
