"""Moving entries in and out of a store: mxdb's own export, vLLM and FlagGems tables.

``mxdb`` format: one JSON document (``StoreExport``) with the fingerprints and
entries, lossless; ``import`` of it into another store gives the same
dispatches.  ``vllm`` and ``flaggems`` formats hold one config per (E, N, M)
used for both GEMMs: an entry whose two GEMMs differ, or whose alignment block
is not its BLOCK_SIZE_M, is exported as its GEMM1 config and listed as lossy.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mxdb import __version__
from mxdb.configs import GemmConfig, KernelConfig
from mxdb.errors import InvalidInputError, UsageError
from mxdb.fileio import atomic_write_json, atomic_write_text
from mxdb.interop import flaggems, vllm
from mxdb.models import Entry, Fingerprint, utcnow
from mxdb.shapes import canonical_dtype

if TYPE_CHECKING:
    from mxdb.store import Store

EXPORT_SCHEMA = "mxdb.store-export"
EXPORT_VERSION = "1.1"
#: Versions this mxdb reads: 1.1 added the ``baseline`` entry status.
READABLE_VERSIONS = ("1.0", "1.1")
FORMATS = ("mxdb", "vllm", "flaggems")


class StoreExport(BaseModel):
    """A store's fingerprints and entries as one JSON document."""

    model_config = ConfigDict(extra="forbid")

    schema_: Literal["mxdb.store-export"] = Field(default="mxdb.store-export", alias="schema")
    schema_version: Literal["1.0", "1.1"] = "1.1"
    exported_at: datetime = Field(default_factory=utcnow)
    mxdb_version: str = __version__
    fingerprints: dict[str, Fingerprint] = Field(default_factory=dict)
    entries: list[Entry] = Field(default_factory=list)

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True, indent=2)


@dataclass(frozen=True)
class ExportOptions:
    """What to export: verified entries (and baseline records, in the mxdb format) by default.

    The vLLM and FlagGems table formats take verified configs only, of one dtype and routing
    class; a baseline record means "FlagGems' own choice", which those tables already hold.
    """

    statuses: tuple[str, ...] = ("verified", "baseline")
    dtype: str = "bf16"
    routing_class: str = "uniform"
    fingerprint_hash: str | None = None


@dataclass
class ExportReport:
    """What an export wrote."""

    format: str
    files: list[str] = field(default_factory=list)
    entries: int = 0
    lossy: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "files": self.files,
            "entries": self.entries,
            "lossy": self.lossy,
        }


def build_export(store: Store, statuses: Sequence[str] | None = None) -> StoreExport:
    """The export document of every entry with one of ``statuses`` (all entries if None)."""
    entries = store.entries(status=list(statuses) if statuses else None)
    used = {e.fingerprint_hash for e in entries if e.fingerprint_hash}
    fps = {h: fp for h, fp in store.fingerprints().items() if h in used}
    return StoreExport(fingerprints=fps, entries=entries)


def read_export(path: str | Path) -> StoreExport:
    """Read and validate an mxdb export file."""
    from mxdb.fileio import load_json

    p = Path(path)
    data = load_json(p, what="export file")
    if isinstance(data, dict) and data.get("schema") != EXPORT_SCHEMA:
        raise InvalidInputError(
            f"{p} is not an mxdb store export: schema is {data.get('schema')!r}, "
            f"expected {EXPORT_SCHEMA!r}"
        )
    if isinstance(data, dict) and data.get("schema_version") not in READABLE_VERSIONS:
        raise InvalidInputError(
            f"{p} has export schema_version {data.get('schema_version')!r}; this mxdb reads "
            f"{', '.join(READABLE_VERSIONS)}"
        )
    try:
        doc = StoreExport.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise InvalidInputError(f"{p}: invalid export at {loc}: {err['msg']}") from None
    for h, fp in doc.fingerprints.items():
        if fp.hash != h:
            raise InvalidInputError(
                f"{p}: fingerprint key {h} does not match its components' hash {fp.hash}"
            )
    for e in doc.entries:
        if e.fingerprint_hash and e.fingerprint_hash not in doc.fingerprints:
            raise InvalidInputError(
                f"{p}: entry for {e.family} M={e.tokens} names fingerprint "
                f"{e.fingerprint_hash}, which the export does not hold"
            )
    return doc


def import_export(store: Store, path: str | Path) -> dict[str, int]:
    """Add an mxdb export's fingerprints and entries to ``store`` (duplicates are skipped)."""
    doc = read_export(path)
    before = sum(store.count_entries().values())
    store.add_entries(
        [e.model_copy(update={"id": None}) for e in doc.entries],
        fingerprints=list(doc.fingerprints.values()),
    )
    return {"read": len(doc.entries), "added": sum(store.count_entries().values()) - before}


def import_vllm(
    store: Store,
    paths: Sequence[str | Path],
    *,
    hidden: int | None = None,
    topk: int | None = None,
) -> vllm.ImportReport:
    """Import vLLM tables as imported, unverified entries (search seeds, never dispatched)."""
    report = vllm.ImportReport()
    entries: list[Entry] = []
    for path in vllm.expand_paths(paths):
        report.files += 1
        try:
            found = vllm.table_entries(path, hidden=hidden, topk=topk)
        except InvalidInputError as exc:
            report.skipped.append(str(exc))
            continue
        entries.extend(found)
    report.read = len(entries)
    before = sum(store.count_entries(source="vllm").values())
    store.add_entries(entries)
    report.added = sum(store.count_entries(source="vllm").values()) - before
    return report


def export_store(
    store: Store, fmt: str, out: str | Path, options: ExportOptions | None = None
) -> ExportReport:
    """Write the store's best entries in ``fmt`` (mxdb, vllm, flaggems) under ``out``.

    ``mxdb``: ``out`` is the file to write (or a folder, which gets ``mxdb-export.json``).
    ``vllm``: one ``E=..,N=..,device_name=...json`` per table in folder ``out``.
    ``flaggems``: ``out/fused_moe_config.yaml``.
    """
    opts = options or ExportOptions()
    if fmt not in FORMATS:
        raise UsageError(f"export format {fmt!r} unknown; use one of {', '.join(FORMATS)}")
    report = ExportReport(format=fmt)
    out_path = Path(out)
    if fmt == "mxdb":
        doc = build_export(store, opts.statuses)
        target = out_path / "mxdb-export.json" if out_path.is_dir() else out_path
        atomic_write_text(target, doc.to_json() + "\n")
        report.files.append(str(target))
        report.entries = len(doc.entries)
        return report
    tables = best_tables(store, opts, report)
    if fmt == "vllm":
        for (device, experts, inter), configs in sorted(tables.items()):
            name = vllm.TableName(experts, inter, device, None, None).file_name()
            atomic_write_text(out_path / name, vllm.render_table(configs))
            report.files.append(str(out_path / name))
    else:
        nested: dict[str, dict[str, dict[int, GemmConfig]]] = {}
        for (device, experts, inter), configs in tables.items():
            nested.setdefault(device, {})[flaggems.table_key(experts, inter)] = configs
        target = out_path / "fused_moe_config.yaml"
        atomic_write_text(target, flaggems.render(nested))
        report.files.append(str(target))
    return report


def best_tables(
    store: Store, opts: ExportOptions, report: ExportReport
) -> dict[tuple[str, int, int], dict[int, GemmConfig]]:
    """{(device, E, N): {M: config}} from the best entry per key (highest speedup, then newest)."""
    dtype = canonical_dtype(opts.dtype)
    chosen: dict[tuple[str, int, int, int], Entry] = {}
    tables_statuses = [s for s in opts.statuses if s != "baseline"]
    for e in store.entries(op="fused_moe", dtype=dtype, status=tables_statuses):
        if e.routing_class != opts.routing_class:
            continue
        if opts.fingerprint_hash and e.fingerprint_hash != opts.fingerprint_hash:
            continue
        key = (vllm.device_key(e.device_name), e.dims["experts"], e.dims["intermediate"], e.tokens)
        old = chosen.get(key)
        if old is None or (e.speedup or 0.0, e.id or 0) > (old.speedup or 0.0, old.id or 0):
            chosen[key] = e
    tables: dict[tuple[str, int, int], dict[int, GemmConfig]] = {}
    for (device, experts, inter, tokens), e in chosen.items():
        config = KernelConfig.parse(e.config)
        if config.gemm1 != config.gemm2 or config.align_block != config.gemm1.block_m:
            report.lossy.append(
                f"{device} E={experts} N={inter} M={tokens}: {config.short()} exported as GEMM1 only"
            )
        tables.setdefault((device, experts, inter), {})[tokens] = config.gemm1
        report.entries += 1
    return tables


def write_export_json(path: str | Path, doc: StoreExport) -> Path:
    return atomic_write_json(path, json.loads(doc.to_json()))
