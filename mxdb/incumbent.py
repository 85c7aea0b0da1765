"""The incumbent: the fused-MoE config a user's engine runs today, for one device and shape.

mxdb is judged against what the user would run without it.  For a (device, shape, M) that is
the row vLLM's table for that device name holds for (E, N) at the nearest M (vLLM, and
FlagGems built from its source tree, whose tables for the devices vLLM covers are the same
rows), and only where no such table exists FlagGems' default config (``get_default_config``,
what the FlagGems wheel runs: it ships no tables).

The tables come from two places, the first that has one for (device, E, N) wins:

1. tables imported into the store (``mxdb import vllm``): an engine that runs its own
   tables has them imported;
2. vLLM 0.33.0's unquantized tables, shipped with mxdb (``mxdb/data/vllm/``, provenance in
   ``PROVENANCE.md`` there).

Only fp16/bf16 shapes have a table row (the tables are unquantized).  vLLM uses one config
for both GEMMs, aligned to its BLOCK_SIZE_M: :meth:`mxdb.configs.KernelConfig.uniform`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mxdb.configs import GemmConfig, KernelConfig
from mxdb.errors import ConfigError
from mxdb.interop import vllm
from mxdb.shapes import MOE_OP, MoEShape

if TYPE_CHECKING:
    from mxdb.store import Store

#: The vLLM tables shipped with mxdb.
TABLES_DIR = Path(__file__).resolve().parent / "data" / "vllm"
#: Where an incumbent comes from.
SHIPPED = "vllm"
IMPORTED = "imported"
DEFAULT = "flaggems_default"
#: The dtypes a table row serves (vLLM's unquantized tables).
TABLE_DTYPES = ("bf16", "fp16")

#: (E, N) -> {M: config}: the rows of one device's tables
Tables = Mapping[tuple[int, int], Mapping[int, GemmConfig]]


@dataclass(frozen=True)
class Incumbent:
    """The config the user's engine runs for one shape, and where it comes from."""

    config: KernelConfig
    #: ``vllm`` (a shipped table), ``imported`` (a table imported into the store) or
    #: ``flaggems_default``
    source: str
    #: the table's file name (None for FlagGems' default)
    table: str | None = None
    #: the table row's token count (vLLM's nearest M; None for FlagGems' default)
    table_tokens: int | None = None

    @property
    def is_table_row(self) -> bool:
        return self.source != DEFAULT

    def describe(self) -> str:
        """One line naming the config's origin: the table and row, or FlagGems' default."""
        if self.table is None:
            return "FlagGems' default config (no table for this device and shape)"
        where = "shipped vLLM 0.33.0 table" if self.source == SHIPPED else "imported table"
        return f"{where} {self.table}, row M={self.table_tokens}"


@functools.lru_cache(maxsize=64)
def shipped_tables(
    device_name: str | None,
) -> dict[tuple[int, int], tuple[str, dict[int, GemmConfig]]]:
    """The shipped vLLM tables of a device: (E, N) -> (file name, {M: config}).

    ``device_name`` is the GPU's name as torch reports it; vLLM's own rule maps it to the
    name in its file names (:func:`mxdb.interop.vllm.device_key`).  A table without a dtype
    in its name is preferred over a ``dtype=bf16`` one of the same (E, N).
    """
    if not device_name:
        return {}
    device = vllm.device_key(device_name)
    out: dict[tuple[int, int], tuple[str, dict[int, GemmConfig]]] = {}
    # a name with a dtype sorts after the plain one of the same (E, N): the plain one wins
    for path in sorted(TABLES_DIR.glob(f"E=*,N=*,device_name={device}*.json")):
        name = vllm.parse_table_name(path.name)
        if name.device_name != device or name.block_shape:
            continue
        if name.dtype is not None and name.dtype.lower() != "bf16":
            continue
        key = (name.experts, name.intermediate)
        if key not in out:
            out[key] = (path.name, vllm.read_table(path))
    return out


def imported_tables(store: Store, dtype: str, device_name: str | None) -> Tables:
    """The vLLM tables imported into ``store`` for a device, as (E, N) -> {M: config}."""
    if not device_name:
        return {}
    return imported_vllm_rows(store, dtype, vllm.device_key(device_name))


def imported_vllm_rows(
    store: Store, dtype: str, device: str
) -> dict[tuple[int, int], dict[int, GemmConfig]]:
    """vLLM's own rows for ``device``, from imported unquantized tables (no dtype in the name)."""
    out: dict[tuple[int, int], dict[int, GemmConfig]] = {}
    for e in store.entries(op=MOE_OP, dtype=dtype, status="imported", source="vllm"):
        if vllm.device_key(e.device_name) != device:
            continue
        try:
            name = vllm.parse_table_name(e.evidence or "")
        except Exception:
            continue
        if name.dtype or name.block_shape:
            continue
        cfg = _uniform_gemm(e.config)
        if cfg is None:
            continue
        key = (int(e.dims["experts"]), int(e.dims["intermediate"]))
        out.setdefault(key, {})[e.tokens] = cfg
    return out


def _uniform_gemm(config: Any) -> GemmConfig | None:
    """The GEMM config of a stored config that is one config for both GEMMs, else None."""
    try:
        cfg = KernelConfig.parse(config)
    except ConfigError:
        return None
    return cfg.gemm1 if cfg.single else None


def incumbent(
    shape: MoEShape, device_name: str | None, imported: Tables | None = None
) -> Incumbent:
    """The incumbent for ``shape`` on the device named ``device_name`` (see the module doc).

    ``imported``: tables imported into the store for this device and the shape's dtype
    (:func:`imported_tables`); they come before the shipped ones.
    """
    if shape.dtype in TABLE_DTYPES:
        key = (shape.experts, shape.intermediate)
        rows = (imported or {}).get(key)
        if rows:
            m = vllm.nearest(rows, shape.tokens)
            name = vllm.TableName(shape.experts, shape.intermediate, vllm.device_key(device_name),
                                  None, None).file_name()  # fmt: skip
            return Incumbent(KernelConfig.uniform(rows[m]), IMPORTED, name, m)
        shipped = shipped_tables(device_name).get(key)
        if shipped is not None:
            name, table = shipped
            m = vllm.nearest(table, shape.tokens)
            return Incumbent(KernelConfig.uniform(table[m]), SHIPPED, name, m)
    from mxdb.tune.space import flaggems_default

    return Incumbent(flaggems_default(shape), DEFAULT)
