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
from mxdb.shapes import DTYPES, MAX_DIMS, PRESETS, MoEShape, canonical_dtype

_NAME = re.compile(
    r"^E=(?P<E>\d+),N=(?P<N>\d+),device_name=(?P<device>[^,]+?)"
    r"(?:,dtype=(?P<dtype>[^,]+?))?(?:,block_shape=(?P<block>\[[^\]]*\]))?\.json$",
    re.ASCII,
)


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


#: The token counts vLLM's tuner (benchmarks/kernels/benchmark_moe.py) writes by default.
TUNER_BATCH_SIZES: tuple[int, ...] = (
    1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096,
)  # fmt: skip

_WHITESPACE_OR_SLASH = re.compile(r"[\s/]+")


def device_key(device_name: str | None) -> str:
    """The device name in vLLM's table file names, by vLLM 0.33's own rule.

    ``get_device_name_as_file_name`` turns every run of whitespace and ``/`` into one ``_``;
    ``get_config_file_name`` then maps any name with an ``H200`` part (``NVIDIA H200 NVL``,
    ``NVIDIA H200 141GB HBM3e``) to ``NVIDIA_H200``.
    """
    name = _WHITESPACE_OR_SLASH.sub("_", device_name or "unknown")
    if "H200" in name.split("_"):
        return "NVIDIA_H200"
    return name


def read_table(path: str | Path) -> dict[int, GemmConfig]:
    """Read one vLLM table: {M: GemmConfig}; a row that cannot be read is an error."""
    table, skipped = read_table_rows(path)
    if skipped:
        raise InvalidInputError(skipped[0])
    return table


def read_table_rows(path: str | Path) -> tuple[dict[int, GemmConfig], list[str]]:
    """Read one vLLM table: ({M: GemmConfig}, [why each unreadable row was skipped]).

    ``triton_version`` is dropped, as vLLM drops it.  A row with keys mxdb does not know
    (beyond the six tile keys and ``EXTRA_LAUNCH_KEYS``, which are kept) is skipped with a
    message naming the file and the row's key; the table's other rows are kept.
    """
    from mxdb.fileio import MAX_SMALL_BYTES, load_json

    p = Path(path)
    data = load_json(p, what="vLLM table", limit=MAX_SMALL_BYTES)
    if not isinstance(data, dict):
        raise InvalidInputError(f"vLLM table {p} must be a JSON object mapping M to a config")
    table: dict[int, GemmConfig] = {}
    skipped: list[str] = []
    for key, value in data.items():
        if key == "triton_version":
            continue  # vLLM pops it before reading the rows
        if not (key.isascii() and key.isdigit()) or not 1 <= int(key) <= MAX_DIMS["tokens"]:
            skipped.append(
                f"vLLM table {p.name}: key {key!r} is not a token count in "
                f"[1, {MAX_DIMS['tokens']:,}]; row skipped"
            )
            continue
        try:
            table[int(key)] = GemmConfig.from_triton(value)
        except ConfigError as exc:
            skipped.append(f"vLLM table {p.name}, key {key!r}: {exc}; row skipped")
    if not table:
        why = f" ({skipped[0]})" if skipped else ""
        raise InvalidInputError(
            f"vLLM table {p} has no readable entries keyed by a token count{why}"
        )
    return table, skipped


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
    skipped: list[str] | None = None,
    shape: tuple[int, int, int, int] | None = None,
) -> list[Entry]:
    """The entries one vLLM table file stands for: imported, unverified, one per (M, dtype).

    ``shape`` (E, H, N, k) names the model the table is for (from ``--model``); otherwise
    H and k come from ``hidden``/``topk`` or a known preset with the same (E, N).  Rows that
    cannot be read are appended to ``skipped`` (naming file and key) and left out.
    """
    file_name = Path(path).name
    name = parse_table_name(str(path))
    if name.block_shape or (name.dtype is not None and name.dtype.lower() not in DTYPES):
        raise InvalidInputError(
            f"{file_name}: quantized tables ({name.dtype or 'block_shape'}) are not "
            "supported; mxdb imports fp16/bf16 tables only"
        )
    rows, bad = read_table_rows(path)
    if skipped is not None:
        skipped.extend(bad)
    return entries_for_rows(
        file_name, rows, hidden=hidden, topk=topk, dtypes=dtypes, shape=shape, evidence=file_name
    )


def entries_for_rows(
    table_name: str,
    rows: dict[int, GemmConfig],
    *,
    hidden: int | None = None,
    topk: int | None = None,
    dtypes: Sequence[str] = ("bf16", "fp16"),
    shape: tuple[int, int, int, int] | None = None,
    source: str = "vllm",
    evidence: str | None = None,
) -> list[Entry]:
    """Imported entries for the rows of one table named like a vLLM table file."""
    name = parse_table_name(table_name)
    if shape is not None and (shape[0], shape[2]) == (name.experts, name.intermediate):
        hidden = hidden if hidden is not None else shape[1]
        topk = topk if topk is not None else shape[3]
    if hidden is None or topk is None:
        preset = _preset_for(name.experts, name.intermediate)
        if preset is not None:
            hidden = hidden if hidden is not None else preset[1]
            topk = topk if topk is not None else preset[3]
    table_dtypes = (
        [canonical_dtype(name.dtype)] if name.dtype else [canonical_dtype(d) for d in dtypes]
    )
    out: list[Entry] = []
    for tokens, gemm in sorted(rows.items()):
        config = KernelConfig.uniform(gemm)
        for dtype in table_dtypes:
            if hidden is not None and topk is not None:
                moe = MoEShape(name.experts, hidden, name.intermediate, topk, tokens, dtype)
                family, dims = moe.family, moe.dims()
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
                    source=source,
                    evidence=evidence or table_name,
                )
            )
    return out


#: Shardings tried when a table's (E, N) is matched against the presets.
_SHARDS = (1, 2, 4, 8, 16)


def _preset_for(experts: int, intermediate: int) -> tuple[int, int, int, int] | None:
    """(E, H, N, k) of the one known model whose shard has this (E, N), or None.

    A shard under tensor parallelism tp has N = I / tp; under expert parallelism ep,
    E / ep experts of the full I.  When presets of different (H, k) match, none is taken.
    """
    whole = {(h, k) for e, h, i, k in PRESETS.values() if (e, i) == (experts, intermediate)}
    found = whole or {
        (h, k)
        for e, h, i, k in PRESETS.values()
        if any(e == experts and i == intermediate * tp for tp in _SHARDS[1:])
        or any(e == experts * ep and i == intermediate for ep in _SHARDS[1:])
    }
    if len(found) != 1:
        return None
    h, k = found.pop()
    return experts, h, intermediate, min(k, experts)


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


def render_table(configs: dict[int, GemmConfig], triton_version: str | None = None) -> str:
    """A vLLM table's JSON text as vLLM's tuner writes it.

    ``triton_version`` first (when known), then the rows in increasing M, four-space indent.
    """
    body: dict[str, Any] = {}
    if triton_version:
        body["triton_version"] = triton_version
    body.update({str(m): configs[m].to_triton() for m in sorted(configs)})
    return json.dumps(body, indent=4) + "\n"


def nearest(table: Iterable[int], tokens: int) -> int:
    """The M whose row vLLM (and FlagGems) run at ``tokens``: the nearest, the smaller on a tie.

    Both take ``min(configs.keys(), key=lambda x: abs(x - M))`` over a table whose keys are
    in increasing order (as vLLM's tuner and mxdb write them).
    """
    return min(sorted(table), key=lambda m: abs(m - tokens))
