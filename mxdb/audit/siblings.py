"""The sibling bundles a document names (the sweep a model was trained on, the check it was
calibrated on, the model and sweep a check used): found beside the bundle under audit, never
through a link, and unchanged since the document recorded their SHA-256."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mxdb.audit.findings import FindingSink
from mxdb.errors import MxdbError
from mxdb.evidence.files import sha256_hex
from mxdb.fileio import MAX_DOCUMENT_BYTES, read_bytes


def sibling_bytes(
    sink: FindingSink, rel: str, where: str, ref: Mapping[str, Any], file: str, *, code: str
) -> bytes | None:
    """The bytes of ``file`` in the bundle ``ref`` names (``bundle``: its folder name beside
    the bundle under audit, ``sha256``: of ``file``); None after a finding: ``{code}_missing``
    at ``{where}.bundle`` when it is not there as a plain file of a plain folder name (or is
    unreadable or too large), ``{code}_mismatch`` at ``{where}.sha256`` when its bytes hash
    otherwise."""
    name = str(ref["bundle"])
    root = getattr(sink, "root", None)
    if root is None:
        sink.add(f"{code}_missing", rel, f"{where}.bundle", "the folder of the bundle under "
                 "audit", "unknown", "the sibling bundles cannot be located")  # fmt: skip
        return None
    folder = Path(root).absolute().parent / name
    path = folder / file
    if "/" in name or name in (".", "..") or folder.is_symlink() or path.is_symlink():
        sink.add(f"{code}_missing", rel, f"{where}.bundle", f"{name}/{file}, a regular file "
                 "beside this bundle", name, "not a plain folder name, or a symbolic link "
                 "(links are never followed)")  # fmt: skip
        return None
    try:
        data = read_bytes(path, limit=MAX_DOCUMENT_BYTES, what=f"{name}/{file}")
    except MxdbError as exc:  # missing, unreadable, not a regular file, too large
        sink.add(f"{code}_missing", rel, f"{where}.bundle", f"{name}/{file} beside this bundle",
                 str(exc)[:160], f"the bundle {where} names is not beside this one")  # fmt: skip
        return None
    sha = sha256_hex(data)
    if sha != ref["sha256"]:
        sink.add(f"{code}_mismatch", rel, f"{where}.sha256", sha, ref["sha256"],
                 f"{name}/{file} is not the document {where} names")  # fmt: skip
        return None
    return data
