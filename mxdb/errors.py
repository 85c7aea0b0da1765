"""The exceptions mxdb raises: one base class, a small hierarchy.

Each class's docstring is its meaning.  Messages say what was asked, what was
found and how to fix it; the CLI maps ``UsageError`` to exit code 2 and every
other ``MxdbError`` to exit code 1.
"""

from __future__ import annotations


class MxdbError(Exception):
    """Base class of every error mxdb raises on purpose."""

    exit_code: int = 1


class UsageError(MxdbError):
    """The caller asked for something malformed: a bad argument, value or combination."""

    exit_code = 2


class InvalidInputError(UsageError):
    """An input file or value does not have the form mxdb accepts."""


class ShapeError(InvalidInputError):
    """A shape is impossible: a non-positive size, top-k above the expert count, an unknown dtype."""


class ConfigError(InvalidInputError):
    """A kernel configuration is malformed or violates its own constraints."""


class TraceError(InvalidInputError):
    """A routing trace (top-k expert ids) is malformed: empty, wrong rank, out of range, ..."""


class WorkloadError(InvalidInputError):
    """A tuning workload file is malformed or names something mxdb does not know."""


class StoreError(MxdbError):
    """The store (database) cannot be opened, read or written."""


class SchemaTooNewError(StoreError):
    """The database was written by a newer mxdb whose schema this version does not know."""


class CorruptStoreError(StoreError):
    """The database file is not a database, or its contents are inconsistent."""


class NotFoundError(MxdbError):
    """A requested record (entry, fingerprint, bundle, file) does not exist."""


class StoreNotFoundError(StoreError, NotFoundError):
    """A command that only reads was pointed at a store that does not exist (none is created)."""


class EvidenceError(MxdbError):
    """An evidence bundle cannot be written or read as a whole."""


class GpuUnavailableError(MxdbError):
    """The operation needs a GPU with torch, triton and flag_gems, and none is usable here."""


class OutputError(MxdbError):
    """An output file or folder cannot be written: a full disk, no permission, a read-only disk."""


class OutputPathError(OutputError, UsageError):
    """An output path cannot be used at all: a part of it is a file, it is a folder, a bad name."""
