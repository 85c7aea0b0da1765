"""vLLM's fused-MoE table files: read them as imported entries, write verified ones back.

A vLLM table is ``E={E},N={N},device_name={device}[,dtype={dtype}][,block_shape=[..]].json``
mapping token counts M to one Triton config, used for both GEMMs; vLLM picks
the entry with the nearest M.  N is the per-expert intermediate size I
(``w2.shape[2]``).  Unquantized tables carry no dtype in their name and serve
both fp16 and bf16.  The hidden size and top-k are not in the table: mxdb
takes them from the caller or from a known model preset with the same (E, N).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mxdb.configs import GemmConfig, KernelConfig
from mxdb.errors import ConfigError, InvalidInputError
from mxdb.models import Entry
from mxdb.shapes import MAX_DIMS, PRESETS, MoEShape, canonical_dtype

_NAME = re.compile(
    r"^E=(?P<E>\d+),N=(?P<N>\d+),device_name=(?P<device>[^,]+?)"
    r"(?:,dtype=(?P<dtype>[^,]+?))?(?:,block_shape=(?P<block>\[[^\]]*\]))?\.json$",
    re.ASCII,
)

#: Quantized table dtypes mxdb does not handle (its kernels are fp16/bf16).
_QUANTIZED = {"fp8_w8a8", "int8_w8a16", "int8_w8a8", "int4_w4a16", "fp8_w8a16", "mxfp4"}


@dataclass(frozen=True)
class TableName:
    """The facts a vLLM table's file name carries."""

    experts: int
    intermediate: int
    device_name: str
    dtype: str | None
    block_shape: str | None

    def file_name(self) -> str:
        name = f"E={self.experts},N={self.intermediate},device_name={self.device_name}"
        if self.dtype:
            name += f",dtype={self.dtype}"
        if self.block_shape:
            name += f",block_shape={self.block_shape}"
        return name + ".json"


def parse_table_name(name: str) -> TableName:
    """Parse a vLLM table file name; raise InvalidInputError naming the expected form."""
    match = _NAME.match(Path(name).name)
    if not match:
        raise InvalidInputError(
            f"{name!r} is not a vLLM fused-MoE table name; expected "
            "'E=<experts>,N=<intermediate>,device_name=<device>[,dtype=<dtype>].json'"
        )
    for part, value in (("E", match["E"]), ("N", match["N"])):
        limit = MAX_DIMS["experts" if part == "E" else "intermediate"]
        if not 1 <= int(value) <= limit:
            raise InvalidInputError(
                f"{Path(name).name!r}: {part}={value} is not a valid size; "
                f"{part} must be in [1, {limit:,}]"
            )
    return TableName(
        experts=int(match["E"]),
        intermediate=int(match["N"]),
        device_name=match["device"],
        dtype=match["dtype"],
        block_shape=match["block"],
    )


def device_key(device_name: str | None) -> str:
    """vLLM's spelling of a device name: spaces become underscores."""
    return (device_name or "unknown").replace(" ", "_")


def read_table(path: str | Path) -> dict[int, GemmConfig]:
    """Read one vLLM table: {M: GemmConfig}. Non-config keys (e.g. triton_version) are ignored."""
    from mxdb.fileio import MAX_SMALL_BYTES, load_json

    p = Path(path)
    data = load_json(p, what="vLLM table", limit=MAX_SMALL_BYTES)
    if not isinstance(data, dict):
        raise InvalidInputError(f"vLLM table {p} must be a JSON object mapping M to a config")
    table: dict[int, GemmConfig] = {}
    for key, value in data.items():
        if not (key.isascii() and key.isdigit()):
            continue  # e.g. "triton_version", which vLLM itself ignores
        if not 1 <= int(key) <= MAX_DIMS["tokens"]:
            raise InvalidInputError(
                f"vLLM table {p}: key {key!r} is not a token count in [1, {MAX_DIMS['tokens']:,}]"
            )
        try:
            table[int(key)] = GemmConfig.from_triton(value)
        except ConfigError as exc:
            raise InvalidInputError(f"vLLM table {p}, entry M={key}: {exc}") from None
    if not table:
        raise InvalidInputError(f"vLLM table {p} has no entries keyed by a token count")
    return table


@dataclass
class ImportReport:
    """What an import read, added and skipped."""

    files: int = 0
    read: int = 0
    added: int = 0
    skipped: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "read": self.read,
            "added": self.added,
            "skipped": self.skipped,
        }


def table_entries(
    path: str | Path,
    *,
    hidden: int | None = None,
    topk: int | None = None,
    dtypes: Sequence[str] = ("bf16", "fp16"),
) -> list[Entry]:
    """The entries one vLLM table file stands for: imported, unverified, one per (M, dtype)."""
    name = parse_table_name(str(path))
    if name.dtype in _QUANTIZED or name.block_shape:
        raise InvalidInputError(
            f"{Path(path).name}: quantized tables ({name.dtype or 'block_shape'}) are not "
            "supported; mxdb imports fp16/bf16 tables only"
        )
    if hidden is None or topk is None:
        preset = _preset_for(name.experts, name.intermediate)
        if preset is not None:
            hidden = hidden if hidden is not None else preset[1]
            topk = topk if topk is not None else preset[3]
    table_dtypes = (
        [canonical_dtype(name.dtype)] if name.dtype else [canonical_dtype(d) for d in dtypes]
    )
    out: list[Entry] = []
    for tokens, gemm in sorted(read_table(path).items()):
        config = KernelConfig.uniform(gemm)
        for dtype in table_dtypes:
            if hidden is not None and topk is not None:
                shape = MoEShape(name.experts, hidden, name.intermediate, topk, tokens, dtype)
                family, dims = shape.family, shape.dims()
            else:
                family = f"E{name.experts}-I{name.intermediate}"
                dims = {
                    "experts": name.experts,
                    "intermediate": name.intermediate,
                    "tokens": tokens,
                }
            out.append(
                Entry(
                    op="fused_moe",
                    dtype=dtype,
                    family=family,
                    dims=dims,
                    tokens=tokens,
                    routing_class="uniform",
                    config=config.model_dump(),
                    config_hash=config.hash,
                    device_name=name.device_name,
                    status="imported",
                    source="vllm",
                    evidence=Path(path).name,
                )
            )
    return out


def _preset_for(experts: int, intermediate: int) -> tuple[int, int, int, int] | None:
    for preset in PRESETS.values():
        if preset[0] == experts and preset[2] == intermediate:
            return preset
    return None


def expand_paths(paths: Iterable[str | Path]) -> list[Path]:
    """Files as given, and the ``*.json`` tables inside any folder given."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = sorted(q for q in p.glob("E=*.json") if q.is_file())
            if not found:
                raise InvalidInputError(f"folder {p} holds no vLLM tables (E=...,N=...json)")
            out.extend(found)
        elif p.exists():
            out.append(p)
        else:
            raise InvalidInputError(f"{p} does not exist; give vLLM table files or folders of them")
    return out


def render_table(configs: dict[int, GemmConfig]) -> str:
    """A vLLM table's JSON text, keys in increasing M, four-space indent like vLLM's files."""
    body = {str(m): configs[m].to_triton() for m in sorted(configs)}
    return json.dumps(body, indent=4) + "\n"
