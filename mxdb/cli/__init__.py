"""The ``mxdb`` command line: a thin layer over the library.

Each command parses its options, calls one library function and turns an
``MxdbError`` into a message on stderr and an exit code (1 failure or
findings, 2 usage).  Machine output goes to stdout.
"""

from __future__ import annotations

from mxdb.cli import audit_cmds, drift_cmds, model_cmds, store_cmds, trace_cmds, tune_cmds
from mxdb.cli.app import cli, main

__all__ = [
    "audit_cmds",
    "cli",
    "drift_cmds",
    "main",
    "model_cmds",
    "store_cmds",
    "trace_cmds",
    "tune_cmds",
]
