"""FlagGems' embedded fused-MoE table (``fused_moe_config.yaml``): write and read it.

Layout, as FlagGems 5.0.2 reads it::

    <DEVICE>:                       # device name, spaces as underscores (NVIDIA_H200)
      "<E>,<N>,<dtype>,<block_n>,<block_k>":    # dtype None for fp16/bf16; 0,0 unquantized
        "<M>": [BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, num_warps, num_stages]

FlagGems picks the entry with the nearest M and uses it for both GEMMs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mxdb.configs import GemmConfig
from mxdb.errors import InvalidInputError
from mxdb.shapes import MAX_DIMS

ORDER = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")

HEADER = """\
# Fused-MoE kernel configs in FlagGems' embedded-table layout, written by mxdb export.
# <DEVICE>:
#   "<E>,<N>,<dtype>,<block_n>,<block_k>":
#     "<M>": [BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, num_warps, num_stages]
"""


def table_key(experts: int, intermediate: int, dtype: str | None = None) -> str:
    """FlagGems' key of one (E, N) table; unquantized tables use dtype None and block 0,0."""
    return f"{experts},{intermediate},{dtype},0,0"


def render(tables: dict[str, dict[str, dict[int, GemmConfig]]]) -> str:
    """YAML text for {device: {key: {M: config}}}, M in increasing order."""
    lines = [HEADER.rstrip("\n")]
    for device in sorted(tables):
        lines.append(f"{device}:")
        for key in sorted(tables[device]):
            lines.append(f'  "{key}":')
            for m in sorted(tables[device][key]):
                t = tables[device][key][m].to_triton()
                values = ",".join(str(t[k]) for k in ORDER)
                lines.append(f'    "{m}": [{values}]')
    return "\n".join(lines) + "\n"


def parse(text: str, *, source: str = "<text>") -> dict[str, dict[str, dict[int, GemmConfig]]]:
    """Read the YAML the way FlagGems does; the ``_FALLBACK`` device map is skipped."""
    from mxdb.fileio import parse_yaml

    data = parse_yaml(text, what=source)
    if not isinstance(data, dict):
        raise InvalidInputError(f"{source}: expected a mapping of device names to tables")
    out: dict[str, dict[str, dict[int, GemmConfig]]] = {}
    for device, tables in data.items():
        if device == "_FALLBACK":
            continue
        if not isinstance(tables, dict):
            raise InvalidInputError(f"{source}: device {device!r} must map table keys to entries")
        out[str(device)] = {}
        for key, entries in tables.items():
            if not isinstance(entries, dict):
                raise InvalidInputError(f"{source}: {device} {key} must map M to a config")
            out[str(device)][str(key)] = {
                _tokens(m, f"{source}: {device} {key}"): _gemm(v, f"{source}: {device} {key} M={m}")
                for m, v in entries.items()
            }
    return out


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
    return GemmConfig.from_triton(value)
