"""mxdb's version: recorded in every fingerprint and export (the package re-exports it)."""

__version__ = "0.1.0"
