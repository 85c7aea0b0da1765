"""mxdb.interop."""
