"""Reading and writing files, with limits on what is read.

Writing is atomic: a temp file in the same folder, fsync, then rename.  A reader
never sees a half-written file, and a crash leaves the old file (or none) in
place.  New files get the mode the umask gives (``0o666 & ~umask``), like any
other file the user creates.

Reading is bounded, in one place: ``read_bytes`` refuses what is not a regular
file (a FIFO, a device, a socket: opening one never blocks) and anything larger
than its limit, before reading a byte of it; ``parse_json`` refuses nesting
deeper than ``MAX_JSON_DEPTH`` (checked on the raw bytes, before any object is
built), duplicate object keys, NaN and Infinity, and numbers whose magnitude
exceeds ``MAX_NUMBER``.  ``load_yaml`` does the same for YAML and refuses
anchors and aliases.  Every refusal names the limit and raises the caller's
error class (a subclass of ``MxdbError``), so that the CLI turns it into a
message and exit code 2.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mxdb.errors import InvalidInputError, MxdbError, OutputError, OutputPathError

#: Limits on input files, by kind (bytes).  A file above its limit is refused unread.
MAX_DOCUMENT_BYTES = 64 * 2**20  # JSON documents: runs, summaries, exports, manifests
MAX_SMALL_BYTES = 4 * 2**20  # workloads, vLLM tables, fingerprints, signatures, configs
MAX_TRACE_BYTES = 64 * 2**20  # .npy trace files
MAX_TRACE_JSON_BYTES = 16 * 2**20  # JSON trace files (larger traces travel as .npy)
#: Deepest nesting of arrays and objects accepted in a JSON or YAML document.
MAX_JSON_DEPTH = 64
#: Largest magnitude of a number in an input document (int64's maximum).
MAX_NUMBER = 2**63 - 1

_CHUNK = 1 << 20
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


def _mib(n: int) -> str:
    return f"{n:,} bytes ({n / 2**20:.0f} MiB)" if n >= 2**20 else f"{n:,} bytes"


# ---------------------------------------------------------------- writing


def current_umask() -> int:
    """The process umask (read from /proc where possible, without changing it)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically; create parent folders as needed.

    The file gets mode ``0o666 & ~umask``.  Raises ``OutputError`` (exit 1, or 2
    for a path that cannot be a file) naming the path and the reason when the
    folder cannot be created, the disk is full, or the path is not writable.
    """
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise output_error(target, exc) from None
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise output_error(target, exc) from None
        raise
    return target


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], data: Any, *, indent: int | None = 2) -> Path:
    """Write ``data`` as JSON (sorted keys off: the caller's order is kept) atomically."""
    text = json.dumps(data, indent=indent, allow_nan=False, default=str)
    return atomic_write_text(path, text + "\n")


def output_error(path: Path, exc: OSError, *, verb: str = "write") -> OutputError:
    """The error for an ``OSError`` raised while writing (or, with ``verb``, using) ``path``."""
    reason = exc.strerror or str(exc)
    if exc.errno == errno.ENOSPC or exc.errno == errno.EDQUOT:
        return OutputError(
            f"cannot {verb} {path}: the disk is full ({reason}); nothing was left half-written: "
            "free some space or choose another --out"
        )
    if exc.errno in (errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENAMETOOLONG, errno.EINVAL):
        return OutputPathError(
            f"cannot {verb} {path}: {reason} (a part of the path is a file, or the path is a "
            "folder, or the name is invalid); choose another --out"
        )
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return OutputError(f"cannot {verb} {path}: {reason}; check the path and its permissions")
    return OutputError(f"cannot {verb} {path}: {reason}")


# ---------------------------------------------------------------- reading


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def read_bytes(
    path: str | os.PathLike[str],
    *,
    limit: int,
    what: str = "file",
    error: type[MxdbError] = InvalidInputError,
) -> bytes:
    """The bytes of regular file ``path``, at most ``limit`` of them.

    Raises ``error`` when the file is missing, unreadable, not a regular file
    (checked on the open descriptor; a FIFO is opened non-blocking, so this never
    hangs) or larger than ``limit`` (checked before reading).
    """
    p = Path(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(p, flags)
    except FileNotFoundError:
        raise error(f"{what} {str(p)!r} does not exist") from None
    except OSError as exc:
        raise error(f"cannot read {what} {str(p)!r}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{what} {str(p)!r} is {_kind(st.st_mode)}; mxdb reads regular files only")
        if st.st_size > limit:
            raise error(
                f"{what} {str(p)!r} is {st.st_size:,} bytes, above the limit of {_mib(limit)}; "
                "split it or pass a smaller file"
            )
        chunks: list[bytes] = []
        total = 0
        while True:
            chunk = os.read(fd, min(_CHUNK, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise error(f"{what} {str(p)!r} grew above the limit of {_mib(limit)} while read")
        return b"".join(chunks)
    except OSError as exc:
        raise error(f"cannot read {what} {str(p)!r}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def read_text(
    path: str | os.PathLike[str],
    *,
    limit: int,
    what: str = "file",
    error: type[MxdbError] = InvalidInputError,
) -> str:
    """``read_bytes`` decoded as UTF-8; a binary file gets ``error`` naming the first bad byte."""
    data = read_bytes(path, limit=limit, what=what, error=error)
    return decode_text(data, what=f"{what} {str(Path(path))!r}", error=error)


def decode_text(data: bytes, *, what: str, error: type[MxdbError] = InvalidInputError) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(
            f"{what} is not UTF-8 text (byte {exc.start} is 0x{data[exc.start]:02x}); "
            "is it a binary file?"
        ) from None


def json_depth(data: bytes | str, *, stop_above: int | None = None) -> int:
    """The deepest nesting of arrays and objects in JSON text (strings skipped), from the bytes.

    Linear in the size; builds no object.  With ``stop_above``, the answer may be an upper
    bound when it is within that limit, and scanning stops once the limit is exceeded.
    """
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    openers = raw.count(b"[") + raw.count(b"{")
    if stop_above is not None and openers <= stop_above:
        return openers  # an upper bound, already within the limit
    import numpy as np

    text = _STRING.sub(b'""', raw)
    lut = np.zeros(256, dtype=np.int32)
    lut[ord("[")] = lut[ord("{")] = 1
    lut[ord("]")] = lut[ord("}")] = -1
    depth = peak = 0
    for start in range(0, len(text), _CHUNK):
        chunk = np.frombuffer(
            text, dtype=np.uint8, count=min(_CHUNK, len(text) - start), offset=start
        )
        running = np.cumsum(lut[chunk]) + depth
        if running.size:
            peak = max(peak, int(running.max()))
            depth = int(running[-1])
        if stop_above is not None and peak > stop_above:
            break
    return peak


class _Refused(ValueError):
    pass


def _pairs_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Refused(
                f"duplicate key {key!r} in one object (values {out[key]!r} and {value!r}); "
                "each key may appear once"
            )
        out[key] = value
    return out


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > 19 or abs(int(text)) > MAX_NUMBER:
        raise _Refused(
            f"number {text[:40]}{'...' if len(text) > 40 else ''} exceeds the magnitude limit "
            f"{MAX_NUMBER:,} (2**63 - 1)"
        )
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if not abs(value) <= MAX_NUMBER:
        raise _Refused(f"number {text[:40]} exceeds the magnitude limit {MAX_NUMBER:,} (2**63 - 1)")
    return value


def _no_constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number; write a finite number")


def parse_json(
    data: bytes | str,
    *,
    what: str = "JSON document",
    error: type[MxdbError] = InvalidInputError,
    max_depth: int = MAX_JSON_DEPTH,
    parse_constant: Callable[[str], Any] | None = None,
) -> Any:
    """Parse JSON text under the limits of this module; ``error`` names what is wrong."""
    text = decode_text(data, what=what, error=error) if isinstance(data, bytes) else data
    depth = json_depth(text, stop_above=max_depth)
    if depth > max_depth:
        raise error(
            f"{what} nests arrays/objects deeper than the limit of {max_depth} levels; flatten it"
        )
    try:
        return json.loads(
            text,
            object_pairs_hook=_pairs_hook,
            parse_int=_parse_int,
            parse_float=_parse_float,
            parse_constant=parse_constant or _no_constant,
        )
    except _Refused as exc:
        raise error(f"{what}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise error(f"{what} is not valid JSON: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise error(f"{what} is not acceptable JSON: {exc}") from None


def load_json(
    path: str | os.PathLike[str],
    *,
    what: str = "JSON file",
    limit: int = MAX_DOCUMENT_BYTES,
    error: type[MxdbError] = InvalidInputError,
    max_depth: int = MAX_JSON_DEPTH,
) -> Any:
    """Read (``read_bytes``) and parse (``parse_json``) one JSON file."""
    data = read_bytes(path, limit=limit, what=what, error=error)
    return parse_json(data, what=f"{what} {str(Path(path))!r}", error=error, max_depth=max_depth)


def parse_yaml(
    text: str,
    *,
    what: str = "YAML document",
    error: type[MxdbError] = InvalidInputError,
    max_depth: int = MAX_JSON_DEPTH,
) -> Any:
    """``yaml.safe_load`` under the same limits: depth, duplicate keys, no anchors or aliases."""
    import yaml

    class _Loader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()  # type: ignore[no-untyped-call]
                raise _Refused(f"alias *{event.anchor} at {event.start_mark}: aliases are refused")
            self.depth += 1
            if self.depth > max_depth:
                raise _Refused(f"nests deeper than the limit of {max_depth} levels; flatten it")
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    dup = key in seen
                    seen.add(key)
                except TypeError:
                    dup = False
                if dup:
                    raise _Refused(f"duplicate key {key!r} at {key_node.start_mark}")
            return super().construct_mapping(node, deep=deep)

    try:
        return yaml.load(text, Loader=_Loader)
    except _Refused as exc:
        raise error(f"{what}: {exc}") from None
    except yaml.YAMLError as exc:
        raise error(f"{what} is not valid YAML: {exc}") from None
    except (ValueError, TypeError, RecursionError, OverflowError) as exc:
        raise error(f"{what} is not acceptable YAML: {exc}") from None
