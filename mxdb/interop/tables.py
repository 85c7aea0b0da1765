"""The rows mxdb writes into vLLM's and FlagGems' tables: dense, measured, one fingerprint.

vLLM 0.33 reads ``$VLLM_TUNED_CONFIG_FOLDER/E=..,N=..,device_name=....json`` before its own
folder, and the file it finds *replaces* its whole table for that (E, N); FlagGems reads one
YAML table per device.  Both pick the row with the nearest token count M and use its config
for both GEMMs.  So a table mxdb writes must hold a row at every M vLLM's tuner writes
(``vllm.TUNER_BATCH_SIZES``, 1 ... 4096), and every row must be a config that was measured
as one config for both GEMMs.  Each row, for the chosen fingerprint, dtype and routing class:

1. a ``baseline`` record at that M: the tuner measured that nothing beat FlagGems' choice
   (the incumbent's row among the candidates), so the row is FlagGems' config (the dispatcher
   answers the same there);
2. else a ``parity`` record's config (a peer's row at parity with FlagGems' choice, which the
   dispatcher answers there);
3. else the verified *uniform* entry with the highest speedup;
4. else, where the verified entry is split (two GEMM configs, another alignment block or
   another implementation than FlagGems', which these tables cannot express), the best single config the tuner measured beside it
   (a ``tune-single`` record), else the baseline config that entry was measured against;
5. else vLLM's own row at that M (the incumbent, :mod:`mxdb.incumbent`), from a vLLM table
   imported for the same device, else from vLLM's table for that device shipped with mxdb;
6. else (no measurement and no imported vLLM table) the row of the nearest M decided above,
   which is the row vLLM itself would have used with a shorter table; such rows are listed.

Never written: half of a split entry, an entry of another fingerprint, a rejected or stale one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mxdb.configs import GemmConfig, KernelConfig
from mxdb.errors import ConfigError, UsageError
from mxdb.incumbent import TABLE_DTYPES, imported_vllm_rows, shipped_tables
from mxdb.interop import vllm
from mxdb.models import DECIDED_STATUSES, SINGLE_SOURCE, Entry, Fingerprint
from mxdb.resources import flaggems_default_config
from mxdb.shapes import MOE_OP, MoEShape, canonical_dtype

if TYPE_CHECKING:
    from mxdb.store import Store


#: Where a row came from, best first.
ROW_SOURCES = ("baseline", "parity", "verified", "single", "baseline-config", "vllm", "nearest")


@dataclass(frozen=True)
class Row:
    """One row of an exported table."""

    config: GemmConfig
    source: str
    entry_id: int | None = None


@dataclass
class Table:
    """One (E, N) table of one device."""

    experts: int
    intermediate: int
    rows: dict[int, Row] = field(default_factory=dict)

    def configs(self) -> dict[int, GemmConfig]:
        return {m: r.config for m, r in sorted(self.rows.items())}


@dataclass
class TableSet:
    """Every table of one fingerprint."""

    fingerprint: Fingerprint | None
    fingerprint_hash: str
    device_name: str | None
    triton_version: str | None
    tables: dict[tuple[int, int], Table] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def rows(self) -> int:
        return sum(len(t.rows) for t in self.tables.values())

    def sources(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tables.values():
            for r in t.rows.values():
                out[r.source] = out.get(r.source, 0) + 1
        return {s: out[s] for s in ROW_SOURCES if s in out}


def fingerprints_with_entries(store: Store) -> dict[str, str | None]:
    """{fingerprint hash: device name} of the fingerprints that have tuned MoE entries."""
    out: dict[str, str | None] = {}
    for e in store.entries(op=MOE_OP, status=DECIDED_STATUSES):
        if e.fingerprint_hash:
            out.setdefault(e.fingerprint_hash, e.device_name)
    return out


def resolve_fingerprint(store: Store, fingerprint_hash: str) -> str:
    """Check that ``fingerprint_hash`` has tuned entries in ``store``; say which do if not."""
    known = fingerprints_with_entries(store)
    if fingerprint_hash in known:
        return fingerprint_hash
    listing = ", ".join(f"{h} ({d or 'unknown device'})" for h, d in sorted(known.items()))
    raise UsageError(
        f"the store holds no tuned fused-MoE entries for fingerprint {fingerprint_hash}; "
        + (
            f"it holds entries of {listing}: pass --fingerprint HASH"
            if listing
            else "it holds none at all (run mxdb tune, or mxdb import mxdb EXPORT.json)"
        )
    )


def build(
    store: Store,
    fingerprint_hash: str,
    *,
    dtype: str = "bf16",
    routing_class: str = "uniform",
    batch_sizes: tuple[int, ...] = vllm.TUNER_BATCH_SIZES,
) -> TableSet:
    """The dense tables of one fingerprint (see the module docstring for the row rule)."""
    dtype = canonical_dtype(dtype)
    fp = store.get_fingerprint(fingerprint_hash)
    entries = [
        e
        for e in store.entries(op=MOE_OP, dtype=dtype, fingerprint_hash=fingerprint_hash)
        if e.routing_class == routing_class
        and (e.status in DECIDED_STATUSES or (e.status == "imported" and e.source == SINGLE_SOURCE))
    ]
    device = fp.device_name if fp is not None and fp.device_name else None
    if device is None:
        device = next((e.device_name for e in entries if e.device_name), None)
    out = TableSet(
        fingerprint=fp,
        fingerprint_hash=fingerprint_hash,
        device_name=device,
        triton_version=fp.triton if fp is not None else None,
    )
    by_family: dict[tuple[int, int], list[Entry]] = {}
    for e in entries:
        key = (int(e.dims["experts"]), int(e.dims["intermediate"]))
        by_family.setdefault(key, []).append(e)
    peers = dict(imported_vllm_rows(store, dtype, vllm.device_key(device)))
    if dtype in TABLE_DTYPES:
        for key, (_, shipped) in shipped_tables(device).items():
            peers.setdefault(key, shipped)
    for (experts, inter), fam in sorted(by_family.items()):
        table = Table(experts, inter)
        decided: dict[int, Row] = {}
        for tokens in sorted({e.tokens for e in fam}):
            row = _measured_row([e for e in fam if e.tokens == tokens], out.notes)
            if row is not None:
                decided[tokens] = row
        peer = peers.get((experts, inter), {})
        for tokens in sorted(set(batch_sizes) | set(decided)):
            if tokens in decided:
                table.rows[tokens] = decided[tokens]
            elif tokens in peer:
                table.rows[tokens] = Row(peer[tokens], "vllm")
        nearest = [m for m in batch_sizes if m not in table.rows]
        if nearest and decided:
            for tokens in nearest:
                near = decided[vllm.nearest(decided, tokens)]
                table.rows[tokens] = Row(near.config, "nearest", near.entry_id)
            out.notes.append(
                f"E={experts} N={inter}: no measurement and no imported vLLM table for "
                f"{vllm.device_key(device)} at M={','.join(map(str, nearest))}; those rows "
                "repeat the nearest measured row (what vLLM runs with a shorter table); "
                "import vLLM's own table (mxdb import vllm) to write its rows there instead"
            )
        if table.rows:
            out.tables[(experts, inter)] = table
    return out


def _measured_row(at_key: list[Entry], notes: list[str]) -> Row | None:
    """The row of one key (family, M) from its tuned entries, or None."""
    baselines = [e for e in at_key if e.status == "baseline"]
    if baselines:
        best = max(baselines, key=lambda e: e.id or 0)
        cfg = _uniform_gemm(best)
        if cfg is not None:
            return Row(cfg, "baseline", best.id)
    parity = [e for e in at_key if e.status == "parity" and _uniform_gemm(e) is not None]
    if parity:
        best = max(parity, key=lambda e: (e.speedup or 0.0, e.id or 0))
        cfg = _uniform_gemm(best)
        assert cfg is not None
        return Row(cfg, "parity", best.id)
    verified = [e for e in at_key if e.status == "verified"]
    uniform = [e for e in verified if _uniform_gemm(e) is not None]
    if uniform:
        best = max(uniform, key=lambda e: (e.speedup or 0.0, e.id or 0))
        cfg = _uniform_gemm(best)
        assert cfg is not None
        return Row(cfg, "verified", best.id)
    # a verified or parity entry the tables cannot express (another implementation, a split
    # config): the best single config measured beside it, else FlagGems' choice
    verified += [e for e in at_key if e.status == "parity"]
    if not verified:
        return None
    singles = [e for e in at_key if e.source == SINGLE_SOURCE and _uniform_gemm(e) is not None]
    if singles:
        best = max(singles, key=lambda e: (e.speedup or 0.0, e.id or 0))
        cfg = _uniform_gemm(best)
        assert cfg is not None
        return Row(cfg, "single", best.id)
    split = max(verified, key=lambda e: (e.speedup or 0.0, e.id or 0))
    dims = split.dims
    if all(k in dims for k in ("experts", "hidden", "intermediate", "topk")):
        shape = MoEShape(
            dims["experts"], dims["hidden"], dims["intermediate"], dims["topk"], split.tokens,
            split.dtype,
        )  # fmt: skip
        return Row(flaggems_default_config(shape), "baseline-config", split.id)
    notes.append(f"{split.family} M={split.tokens}: split entry without H and k; no row written")
    return None


def _uniform_gemm(e: Entry) -> GemmConfig | None:
    """The entry's config when it is one config of FlagGems' kernels for both GEMMs, aligned
    to its BLOCK_SIZE_M."""
    try:
        cfg = KernelConfig.parse(e.config)
    except ConfigError:
        return None
    return cfg.gemm1 if cfg.single else None


def imported_tables(store: Store) -> dict[str, dict[int, GemmConfig]]:
    """Every imported vLLM table, as read: {file name: {M: config}} (for a lossless round trip)."""
    out: dict[str, dict[int, GemmConfig]] = {}
    for e in store.entries(op=MOE_OP, status="imported", source="vllm"):
        if not e.evidence:
            continue
        cfg = _uniform_gemm(e)
        if cfg is not None:
            out.setdefault(e.evidence, {})[e.tokens] = cfg
    return out


def describe(tables: TableSet) -> dict[str, Any]:
    """A summary of a table set for the CLI's JSON output."""
    return {
        "fingerprint": tables.fingerprint_hash,
        "device_name": tables.device_name,
        "triton_version": tables.triton_version,
        "tables": len(tables.tables),
        "rows": tables.rows(),
        "row_sources": tables.sources(),
    }
