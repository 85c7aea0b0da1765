"""Bundle file mechanics: atomic writes, canonical JSON, SHA-256 manifests and safe paths."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mxdb.fileio import atomic_write_bytes
from mxdb.hashing import canonical_hash

MANIFEST_NAME = "manifest.json"
SIGNATURES_DIR = "signatures"


def dumps(doc: Any) -> bytes:
    """Evidence JSON: sorted keys, floats with repr precision, NaN/Infinity refused."""
    return (json.dumps(doc, sort_keys=True, indent=1, allow_nan=False) + "\n").encode()


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same dir, fsync and ``os.replace``."""
    atomic_write_bytes(path, data)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def manifest_digest(files: Mapping[str, str]) -> str:
    """SHA-256 of ``'<sha256>  <path>\\n'`` lines sorted by path (the format of ``sha256sum``)."""
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(f"{files[path]}  {path}\n".encode())
    return h.hexdigest()


def unsafe_reason(relpath: str) -> str | None:
    """Why a manifest path may not be used, or ``None`` when it is a plain relative POSIX path."""
    if not relpath:
        return "empty path"
    if "\\" in relpath or "\x00" in relpath:
        return "backslash or NUL in path"
    if relpath.startswith("/") or (len(relpath) > 1 and relpath[1] == ":"):
        return "absolute path"
    parts = relpath.split("/")
    if ".." in parts:
        return "'..' escapes the bundle"
    if any(p in ("", ".") for p in parts):
        return "empty or '.' path segment"
    return None


def is_manifested(relpath: str) -> bool:
    """Whether a bundle file belongs in the manifest (all but the manifest and signatures)."""
    return relpath != MANIFEST_NAME and not relpath.startswith(SIGNATURES_DIR + "/")


def scan_tree(root: Path) -> tuple[dict[str, Path], list[str], list[str]]:
    """Every regular file under ``root`` by relative POSIX path, never following links.

    Returns (files, symlinks, special): symbolic links and non-regular entries are listed by
    path, not entered or read.
    """
    files: dict[str, Path] = {}
    links: list[str] = []
    special: list[str] = []
    stack: list[tuple[str, str]] = [(str(root), "")]
    while stack:
        dirpath, prefix = stack.pop()
        with os.scandir(dirpath) as it:
            for entry in it:
                rel = prefix + entry.name
                if entry.is_symlink():
                    links.append(rel)
                elif entry.is_dir(follow_symlinks=False):
                    stack.append((entry.path, rel + "/"))
                elif entry.is_file(follow_symlinks=False):
                    files[rel] = Path(entry.path)
                else:
                    special.append(rel)
    return files, sorted(links), sorted(special)


def trace_hash(experts: int, ids: list[list[int]]) -> str:
    """A trace's identity: SHA-256 of canonical JSON ``{experts, ids}``, 16 hex digits."""
    return canonical_hash({"experts": experts, "ids": ids})
