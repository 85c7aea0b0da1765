"""mxdb.store.migrations.versions."""
