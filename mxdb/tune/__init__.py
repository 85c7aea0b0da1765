"""mxdb.tune."""
