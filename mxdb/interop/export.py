"""Moving entries in and out of a store: mxdb's own export, vLLM and FlagGems tables.

``mxdb`` format: one JSON document (``StoreExport``) with the fingerprints and
entries, lossless; ``import`` of it into another store gives the same
dispatches.  ``vllm`` and ``flaggems`` formats hold one config per (E, N, M)
used for both GEMMs: the rows of one fingerprint, dense and measured, by the rule of
:mod:`mxdb.interop.tables` (never half of a split entry).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mxdb.errors import InvalidInputError, MxdbError, ShapeError, UsageError
from mxdb.fileio import atomic_write_json, atomic_write_text
from mxdb.interop import flaggems, tables, vllm
from mxdb.models import DECIDED_STATUSES, ROUTING_CLASSES, SINGLE_SOURCE, Entry, Fingerprint, utcnow
from mxdb.version import __version__

if TYPE_CHECKING:
    from mxdb.store import Store

EXPORT_SCHEMA = "mxdb.store-export"
EXPORT_VERSION = "1.3"
#: Versions this mxdb reads: 1.1 added the ``baseline`` entry status, 1.2 the held-out
#: validation fields, 1.3 the ``parity`` entry status.
READABLE_VERSIONS = ("1.0", "1.1", "1.2", "1.3")
FORMATS = ("mxdb", "vllm", "flaggems")


class StoreExport(BaseModel):
    """A store's fingerprints and entries as one JSON document."""

    model_config = ConfigDict(extra="forbid")

    schema_: Literal["mxdb.store-export"] = Field(default="mxdb.store-export", alias="schema")
    schema_version: Literal["1.0", "1.1", "1.2", "1.3"] = "1.3"
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

    statuses: tuple[str, ...] = DECIDED_STATUSES
    #: mxdb: also the tuner's single-config records (status imported, source tune-single),
    #: which the table exports write where a verified entry is not one FlagGems config
    singles: bool = True
    dtype: str = "bf16"
    routing_class: str = "uniform"
    #: vllm/flaggems: the fingerprint whose rows to write (required for those formats)
    fingerprint_hash: str | None = None
    #: vllm: write the imported vLLM tables back as read (every device), not tuned rows
    imported: bool = False
    #: flaggems: a table document to merge into (its other devices, keys, _FALLBACK kept);
    #: mxdb: an export to lay this store over (``overlay``)
    merge: Path | None = None
    #: flaggems: write FlagGems' own file (merging into it), with a backup
    install: bool = False


@dataclass
class ExportReport:
    """What an export wrote."""

    format: str
    files: list[str] = field(default_factory=list)
    entries: int = 0
    lossy: list[str] = field(default_factory=list)
    fingerprint: str | None = None
    device_name: str | None = None
    rows: int = 0
    row_sources: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    backup: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "files": self.files,
            "entries": self.entries,
            "lossy": self.lossy,
            "fingerprint": self.fingerprint,
            "device_name": self.device_name,
            "rows": self.rows,
            "row_sources": self.row_sources,
            "notes": self.notes,
            "backup": self.backup,
        }


def build_export(
    store: Store, statuses: Sequence[str] | None = None, *, singles: bool = False
) -> StoreExport:
    """The export document of every entry with one of ``statuses`` (all entries if None), and
    with ``singles`` the tuner's single-config records."""
    entries = store.entries(status=list(statuses) if statuses else None)
    if singles and statuses and "imported" not in statuses:
        extra = store.entries(status="imported", source=SINGLE_SOURCE)
        entries = sorted([*entries, *extra], key=lambda e: e.id or 0)
    used = {e.fingerprint_hash for e in entries if e.fingerprint_hash}
    fps = {h: fp for h, fp in store.fingerprints().items() if h in used}
    return StoreExport(fingerprints=fps, entries=entries)


def _key(e: Entry) -> tuple[Any, ...]:
    return (e.op, e.dtype, e.family, e.tokens, e.routing_class)


def overlay(base: StoreExport, top: StoreExport) -> StoreExport:
    """``top`` laid over ``base``: ``top``'s entries, and ``base``'s at the keys (op, dtype,
    family, M, routing class) ``top`` holds none at; every fingerprint either names.  Ids are
    renumbered in that order (an import assigns its own).  How a store re-tuned at some keys
    replaces an earlier export there and keeps the rest."""
    held = {_key(e) for e in top.entries}
    entries = [e for e in base.entries if _key(e) not in held] + list(top.entries)
    entries = [e.model_copy(update={"id": i}) for i, e in enumerate(entries, 1)]
    return top.model_copy(
        update={"fingerprints": {**base.fingerprints, **top.fingerprints}, "entries": entries}
    )


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
    for i, e in enumerate(doc.entries):
        if e.fingerprint_hash and e.fingerprint_hash not in doc.fingerprints:
            raise InvalidInputError(
                f"{p}: entry for {e.family} M={e.tokens} names fingerprint "
                f"{e.fingerprint_hash}, which the export does not hold"
            )
        problem = entry_problem(e)
        if problem is not None:
            raise InvalidInputError(
                f"{p}: entries[{i}] ({e.op} {e.family} M={e.tokens} {e.routing_class}, "
                f"{e.status}) is rejected: {problem}; nothing was imported (fix or drop the entry)"
            )
    return doc


def entry_problem(e: Entry) -> str | None:
    """Why a stored or imported entry is unusable (the dispatcher could not answer with it),
    or None: its config parses under its op's rules, its config_hash is the hash of its
    config, its dimensions name its family and token count, and its figures are finite."""
    from mxdb.configs import config_hash
    from mxdb.ops import parse_config

    try:
        parsed = parse_config(e.op, e.config)
    except (MxdbError, ValueError, TypeError, KeyError, AttributeError) as exc:
        return f"its config is not a valid {e.op} config ({exc})"
    want = getattr(parsed, "hash", None) or config_hash(e.config)
    if e.config_hash not in (want, config_hash(e.config)):
        return f"config_hash {e.config_hash} is not the hash of its config ({want})"
    if e.dims.get("tokens", e.tokens) != e.tokens:
        return f"dims say tokens={e.dims.get('tokens')} but the entry says {e.tokens}"
    key = _key_problem(e)
    if key is not None:
        return key
    for name in ("speedup", "noise_band", "median_us", "baseline_us"):
        v = getattr(e, name)
        if v is not None and not (math.isfinite(v) and v >= 0):
            return f"{name} {v} is not a finite non-negative number"
    if e.status == "verified" and e.speedup is not None and e.speedup <= 0:
        return f"a verified entry needs a positive speedup, found {e.speedup}"
    return None


def _key_problem(e: Entry) -> str | None:
    """Why an entry's key is not one the store and dispatcher build: a known op, a canonical
    dtype, a routing class, and dimensions that make a valid shape of its family."""
    from mxdb.decode_rule import OP_DIMS
    from mxdb.shapes import MOE_OP, MoEShape, OpShape, canonical_dtype

    if e.op != MOE_OP and e.op not in OP_DIMS:
        return f"op {e.op!r} is unknown; use one of {', '.join((MOE_OP, *OP_DIMS))}"
    try:
        if canonical_dtype(e.dtype) != e.dtype:
            return f"dtype {e.dtype!r} is not a canonical name (write {canonical_dtype(e.dtype)})"
    except ShapeError as exc:
        return str(exc)
    if e.routing_class not in ROUTING_CLASSES:
        return (
            f"routing class {e.routing_class!r} is unknown; use one of {', '.join(ROUTING_CLASSES)}"
        )
    want = (*MoEShape.FIELDS,) if e.op == MOE_OP else (*OP_DIMS[e.op], "tokens")
    if set(e.dims) != set(want):
        return f"dims {sorted(e.dims)} are not those of {e.op} ({', '.join(sorted(want))})"
    try:
        if e.op == MOE_OP:
            fam = MoEShape(**e.dims, dtype=e.dtype).family
        else:
            rest = {k: v for k, v in e.dims.items() if k != "tokens"}
            fam = OpShape(e.op, rest, e.tokens, e.dtype).family
    except ShapeError as exc:
        return f"dims are not a valid {e.op} shape ({exc})"
    if fam != e.family:
        return f"family {e.family} is not that of its dims ({fam})"
    return None


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
    shape: tuple[int, int, int, int] | None = None,
) -> vllm.ImportReport:
    """Import vLLM tables as imported, unverified entries (search seeds, never dispatched).

    Rows with keys mxdb cannot keep are skipped (each named in ``report.skipped`` with its
    file and key); the rest of their table is imported.  ``shape`` (E, H, N, k): the model's
    per-shard MoE shape (``--model``), which names H and k of the table with that (E, N).
    """
    report = vllm.ImportReport()
    entries: list[Entry] = []
    for path in vllm.expand_paths(paths):
        report.files += 1
        try:
            found = vllm.table_entries(
                path, hidden=hidden, topk=topk, skipped=report.skipped, shape=shape
            )
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
    store: Store, fmt: str, out: str | Path | None, options: ExportOptions | None = None
) -> ExportReport:
    """Write the store's rows in ``fmt`` (mxdb, vllm, flaggems).

    ``mxdb``: ``out`` is the file to write (or a folder, which gets ``mxdb-export.json``).
    ``vllm``: one ``E=..,N=..,device_name=...json`` per table in folder ``out``, for
    ``$VLLM_TUNED_CONFIG_FOLDER``.  ``flaggems``: ``out/fused_moe_config.yaml``, or FlagGems'
    own file with ``install``.  The table formats write one fingerprint's rows
    (``options.fingerprint_hash``), dense and measured (:mod:`mxdb.interop.tables`).
    """
    opts = options or ExportOptions()
    if fmt not in FORMATS:
        raise UsageError(f"export format {fmt!r} unknown; use one of {', '.join(FORMATS)}")
    report = ExportReport(format=fmt)
    if out is None and not (fmt == "flaggems" and opts.install):
        raise UsageError("--out is required (or --install, for the flaggems format)")
    out_path = Path(out) if out is not None else None
    if fmt == "mxdb":
        assert out_path is not None
        doc = build_export(store, opts.statuses, singles=opts.singles)
        if opts.merge is not None:
            doc = overlay(read_export(opts.merge), doc)
        target = out_path / "mxdb-export.json" if out_path.is_dir() else out_path
        atomic_write_text(target, doc.to_json() + "\n")
        report.files.append(str(target))
        report.entries = len(doc.entries)
        return report
    if fmt == "vllm" and opts.imported:
        assert out_path is not None
        for name, rows in sorted(tables.imported_tables(store).items()):
            atomic_write_text(out_path / name, vllm.render_table(rows))
            report.files.append(str(out_path / name))
            report.rows += len(rows)
        report.entries = report.rows
        return report
    if not opts.fingerprint_hash:
        raise UsageError(f"the {fmt} format writes one fingerprint's rows: give --fingerprint")
    fp_hash = tables.resolve_fingerprint(store, opts.fingerprint_hash)
    built = tables.build(store, fp_hash, dtype=opts.dtype, routing_class=opts.routing_class)
    report.fingerprint = fp_hash
    report.device_name = built.device_name
    report.rows = built.rows()
    report.entries = report.rows
    report.row_sources = built.sources()
    report.notes = list(built.notes)
    if fmt == "vllm":
        assert out_path is not None
        device = vllm.device_key(built.device_name)
        for (experts, inter), table in sorted(built.tables.items()):
            name = vllm.TableName(experts, inter, device, None, None).file_name()
            text = vllm.render_table(table.configs(), built.triton_version)
            atomic_write_text(out_path / name, text)
            report.files.append(str(out_path / name))
        return report
    device = flaggems.device_key(built.device_name)
    nested = {
        device: {
            flaggems.table_key(e, n): t.configs() for (e, n), t in sorted(built.tables.items())
        }
    } if built.tables else {}  # fmt: skip
    if opts.install:
        target = flaggems.installed_path()
    else:
        assert out_path is not None
        target = out_path / "fused_moe_config.yaml" if out_path.suffix != ".yaml" else out_path
    base_path = opts.merge if opts.merge is not None else (target if opts.install else None)
    base: dict[str, Any] = {}
    if base_path is not None and Path(base_path).exists():
        base = flaggems.load_raw(Path(base_path).read_text(), source=str(base_path))
    elif opts.merge is not None:
        raise InvalidInputError(f"--merge file {opts.merge} does not exist")
    text = flaggems.render_raw(flaggems.merge(base, nested))
    if opts.install:
        backup = flaggems.install(text, target)
        report.backup = str(backup) if backup is not None else None
    else:
        atomic_write_text(target, text)
    report.files.append(str(target))
    return report


def import_flaggems(
    store: Store,
    path: str | Path,
    *,
    shape: tuple[int, int, int, int] | None = None,
    hidden: int | None = None,
    topk: int | None = None,
) -> vllm.ImportReport:
    """Import a FlagGems table document's unquantized rows as imported entries (search seeds).

    Each device's ``"E,N,None,0,0"`` table becomes entries like an imported vLLM table of that
    device (source ``flaggems``); quantized keys and unreadable rows are skipped and named.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise InvalidInputError(f"FlagGems table {p} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"cannot read FlagGems table {p}: {exc}") from None
    report = vllm.ImportReport(files=1)
    parsed, skipped = flaggems.parse_rows(text, source=p.name)
    report.skipped.extend(skipped)
    entries: list[Entry] = []
    for device, keyed in parsed.items():
        for key, rows in keyed.items():
            parts = flaggems.split_key(key)
            if parts is None:
                report.skipped.append(f"{p.name}: {device} key {key!r} is not E,N,dtype,bn,bk")
                continue
            experts, inter, qdtype, bn, bk = parts
            if qdtype is not None or bn or bk:
                report.skipped.append(
                    f"{p.name}: {device} {key}: quantized tables are not supported"
                )
                continue
            name = vllm.TableName(experts, inter, device, None, None).file_name()
            found = vllm.entries_for_rows(
                name, rows, hidden=hidden, topk=topk, shape=shape, source="flaggems",
                evidence=f"{p.name}:{device}:{key}",
            )  # fmt: skip
            entries.extend(found)
    report.read = len(entries)
    before = sum(store.count_entries(source="flaggems").values())
    store.add_entries(entries)
    report.added = sum(store.count_entries(source="flaggems").values()) - before
    return report


def write_export_json(path: str | Path, doc: StoreExport) -> Path:
    return atomic_write_json(path, json.loads(doc.to_json()))
