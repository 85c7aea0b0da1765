"""Atomic file writing: a temp file in the same folder, fsync, then rename.

A reader never sees a half-written file, and a crash leaves the old file (or
none) in place.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically; create parent folders as needed."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return target


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], data: Any, *, indent: int | None = 2) -> Path:
    """Write ``data`` as JSON (sorted keys off: the caller's order is kept) atomically."""
    text = json.dumps(data, indent=indent, allow_nan=False, default=str)
    return atomic_write_text(path, text + "\n")
