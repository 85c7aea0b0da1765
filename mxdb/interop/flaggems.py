"""FlagGems' embedded fused-MoE table (``fused_moe_config.yaml``): write and read it.

Layout, as FlagGems 5.0.2 reads it::

    <DEVICE>:                       # device name, spaces as underscores (NVIDIA_H200)
      "<E>,<N>,<dtype>,<block_n>,<block_k>":    # dtype None for fp16/bf16; 0,0 unquantized
        "<M>": [BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, num_warps, num_stages]

FlagGems picks the entry with the nearest M and uses it for both GEMMs.  A top-level
``_FALLBACK`` map names, for a device without a table, the device whose table to use.

FlagGems 5.0.2 reads exactly one file, ``<flag_gems>/utils/configs/fused_moe_config.yaml``
(``get_embedded_moe_configs`` in ``flag_gems/fused/fused_moe.py``, cached for the process):
a missing file means no table; a file whose YAML is not a mapping (an empty or comments-only
document) makes ``data.get`` raise ``AttributeError`` at the first MoE call.  So mxdb never
writes an empty document: an export with no rows is ``{}``.  The device name is
``torch.cuda.get_device_name()`` with spaces as underscores, and any name with an ``H200``
part is ``NVIDIA_H200``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from mxdb.configs import GemmConfig
from mxdb.errors import ConfigError, InvalidInputError, UsageError
from mxdb.fileio import atomic_write_text
from mxdb.shapes import MAX_DIMS

#: Where FlagGems 5.0.2 reads its table, relative to the flag_gems package directory.
INSTALL_RELATIVE = Path("utils") / "configs" / "fused_moe_config.yaml"
FALLBACK = "_FALLBACK"

ORDER = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")

HEADER = """\
# Fused-MoE kernel configs in FlagGems' embedded-table layout, written by mxdb export.
# <DEVICE>:
#   "<E>,<N>,<dtype>,<block_n>,<block_k>":
#     "<M>": [BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, num_warps, num_stages]
"""


def device_key(device_name: str | None) -> str:
    """FlagGems 5.0.2's device key: spaces as underscores; any H200 variant is NVIDIA_H200."""
    name = (device_name or "unknown").replace(" ", "_")
    if "H200" in name.split("_"):
        return "NVIDIA_H200"
    return name


def table_key(experts: int, intermediate: int, dtype: str | None = None) -> str:
    """FlagGems' key of one (E, N) table; unquantized tables use dtype None and block 0,0."""
    return f"{experts},{intermediate},{dtype},0,0"


def render(tables: dict[str, dict[str, dict[int, GemmConfig]]]) -> str:
    """YAML text for {device: {key: {M: config}}}, M in increasing order; ``{}`` when empty."""
    raw: dict[str, Any] = {
        device: {
            key: {m: tables[device][key][m] for m in sorted(tables[device][key])}
            for key in sorted(tables[device])
        }
        for device in sorted(tables)
    }
    return render_raw(raw)


def render_raw(data: dict[str, Any]) -> str:
    """YAML text of a whole table document, in the layout FlagGems ships.

    ``data`` is what ``load_raw`` returns, possibly with mxdb's tables merged in: the
    ``_FALLBACK`` map first, then every device in its order.  Rows are ``GemmConfig`` (written
    as the six-value list) or whatever the document held (lists stay lists; a mapping row is
    written as a flow mapping).  Every scalar key is double-quoted (JSON is valid YAML), so
    the text reads back as the same strings.  A document without devices is ``{}``.
    """
    lines = [HEADER.rstrip("\n")]
    body: list[str] = []
    fallback = data.get(FALLBACK)
    if isinstance(fallback, dict) and fallback:
        body.append(f"{FALLBACK}:")
        for k, v in fallback.items():
            body.append(f"  {_q(k)}: {_q(v)}")
        body.append("")
    for device, tables in data.items():
        if device == FALLBACK:
            continue
        if not isinstance(tables, dict) or not tables:
            body.append(f"{_q(device)}: {{}}")
            continue
        body.append(f"{_q(device)}:")
        for key, rows in tables.items():
            if not isinstance(rows, dict) or not rows:
                body.append(f"  {_q(key)}: {{}}")
                continue
            body.append(f"  {_q(key)}:")
            for m, row in rows.items():
                body.append(f"    {_q(m)}: {_row(row)}")
        body.append("")
    if not body:
        body = ["{}"]
    while body and body[-1] == "":
        body.pop()
    return "\n".join(lines + body) + "\n"


def _q(value: Any) -> str:
    return json.dumps(str(value))


def _row(row: Any) -> str:
    if isinstance(row, GemmConfig):
        t = row.to_triton()
        return "[" + ",".join(str(t[k]) for k in ORDER) + "]"
    return json.dumps(row, separators=(",", ":"))


def load_raw(text: str, *, source: str = "<text>") -> dict[str, Any]:
    """A FlagGems table document as plain data, for merging (nothing in it is interpreted).

    An empty or comments-only document is an empty table (FlagGems itself would fail on it,
    so a merge repairs it); anything else that is not a mapping of devices is an error.
    """
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InvalidInputError(f"{source} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InvalidInputError(f"{source}: expected a mapping of device names to tables")
    for device, tables in data.items():
        if tables is not None and not isinstance(tables, dict):
            raise InvalidInputError(f"{source}: {device!r} must map keys to entries")
    return {str(k): v for k, v in data.items()}


def merge(
    base: dict[str, Any], tables: dict[str, dict[str, dict[int, GemmConfig]]]
) -> dict[str, Any]:
    """``base`` with mxdb's tables put in: each (device, key) mxdb writes replaces that table,
    every other device, key and the ``_FALLBACK`` map are kept as they were."""
    out: dict[str, Any] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for device in sorted(tables):
        current = out.get(device)
        merged: dict[str, Any] = dict(current) if isinstance(current, dict) else {}
        for key in sorted(tables[device]):
            rows = tables[device][key]
            merged[key] = {m: rows[m] for m in sorted(rows)}
        out[device] = merged
    return out


def installed_path() -> Path:
    """The file FlagGems 5.0.2 reads, located without importing flag_gems."""
    try:
        spec = importlib.util.find_spec("flag_gems")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(
            "--install needs flag_gems installed in this Python environment "
            "(pip install flag-gems==5.0.2); write the table with --out instead"
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    return root / INSTALL_RELATIVE


def install(text: str, target: Path) -> Path | None:
    """Write ``text`` to ``target`` atomically; an existing file is first copied to a backup.

    Returns the backup's path (None when there was no file).  The backup is named
    ``fused_moe_config.yaml.mxdb-backup-<UTC time>`` beside the target.
    """
    backup: Path | None = None
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        backup = target.with_name(f"{target.name}.mxdb-backup-{stamp}")
        shutil.copy2(target, backup)
    atomic_write_text(target, text)
    os.chmod(target, 0o644)
    return backup


def parse(text: str, *, source: str = "<text>") -> dict[str, dict[str, dict[int, GemmConfig]]]:
    """Read the YAML the way FlagGems does; the ``_FALLBACK`` device map is skipped."""
    out, skipped = parse_rows(text, source=source)
    if skipped:
        raise InvalidInputError(skipped[0])
    return out


def parse_rows(
    text: str, *, source: str = "<text>"
) -> tuple[dict[str, dict[str, dict[int, GemmConfig]]], list[str]]:
    """Read the YAML the way FlagGems does: (tables, [why each unreadable row was skipped])."""
    from mxdb.fileio import parse_yaml

    data = parse_yaml(text, what=source)
    if not isinstance(data, dict):
        raise InvalidInputError(
            f"{source}: expected a mapping of device names to tables (FlagGems raises "
            "AttributeError on any other document)"
        )
    out: dict[str, dict[str, dict[int, GemmConfig]]] = {}
    skipped: list[str] = []
    for device, tables in data.items():
        if device == FALLBACK:
            continue
        if not isinstance(tables, dict):
            raise InvalidInputError(f"{source}: device {device!r} must map table keys to entries")
        out[str(device)] = {}
        for key, entries in tables.items():
            if not isinstance(entries, dict):
                raise InvalidInputError(f"{source}: {device} {key!r} must map M to a config")
            rows: dict[int, GemmConfig] = {}
            for m, v in entries.items():
                where = f"{source}: {device} {key} M={m}"
                try:
                    rows[_tokens(m, where)] = _gemm(v, where)
                except (InvalidInputError, ConfigError) as exc:
                    skipped.append(f"{exc}; row skipped")
            out[str(device)][str(key)] = rows
    return out, skipped


def read(path: str | Path) -> dict[str, dict[str, dict[int, GemmConfig]]]:
    from mxdb.fileio import MAX_DOCUMENT_BYTES, read_text

    p = Path(path)
    return parse(read_text(p, limit=MAX_DOCUMENT_BYTES, what="FlagGems table"), source=str(p))


def _tokens(key: Any, where: str) -> int:
    text = str(key)
    if not (text.isascii() and text.isdigit() and 1 <= int(text) <= MAX_DIMS["tokens"]):
        raise InvalidInputError(
            f"{where}: key {key!r} is not a token count in [1, {MAX_DIMS['tokens']:,}]"
        )
    return int(text)


def _gemm(value: Any, where: str) -> GemmConfig:
    if isinstance(value, list):
        if len(value) != len(ORDER):
            raise InvalidInputError(f"{where}: expected {len(ORDER)} values ({', '.join(ORDER)})")
        value = dict(zip(ORDER, value, strict=True))
    if not isinstance(value, dict):
        raise InvalidInputError(f"{where}: expected a list of {len(ORDER)} values")
    try:
        return GemmConfig.from_triton(value)
    except ConfigError as exc:
        raise InvalidInputError(f"{where}: {exc}") from None


def split_key(key: str) -> tuple[int, int, str | None, int, int] | None:
    """(E, N, dtype, block_n, block_k) of a table key, or None when it is not one."""
    parts = key.split(",")
    if len(parts) != 5:
        return None
    try:
        e, n, bn, bk = int(parts[0]), int(parts[1]), int(parts[3]), int(parts[4])
    except ValueError:
        return None
    return e, n, (None if parts[2] == "None" else parts[2]), bn, bk
