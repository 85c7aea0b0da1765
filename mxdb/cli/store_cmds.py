"""CLI commands over the store: dispatch, import, export, db info."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, get_args

import click

from mxdb.cli.app import (
    cli,
    db_option,
    emit_json,
    handle_errors,
    json_option,
    model_dims,
    model_options,
    shape_options,
)
from mxdb.errors import InvalidInputError, UsageError
from mxdb.models import DECIDED_STATUSES, ROUTING_CLASSES, EntryStatus
from mxdb.shapes import MoEShape

ENTRY_STATUSES: tuple[str, ...] = get_args(EntryStatus)

F = TypeVar("F", bound=Callable[..., Any])


@cli.command("dispatch")
@shape_options(model=True, dtypes=("fp16", "bf16"))
@click.option(
    "--routing-trace",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Top-k expert ids (JSON or NPY) whose routing class to use.",
)
@click.option(
    "--routing-class",
    type=click.Choice(list(ROUTING_CLASSES)),
    help="Routing class to use (default: uniform).",
)
@click.option(
    "--fingerprint",
    "fingerprint_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Answer as if in the environment recorded in this fingerprint JSON "
    "(e.g. an evidence bundle's fingerprint.json). Default: this machine's.",
)
@click.option(
    "--policy",
    type=click.Choice(["strict", "device"]),
    default="strict",
    show_default=True,
    help="Fingerprint match policy: strict (every component) or device (device, Triton, "
    "FlagGems and kernel source).",
)
@click.option(
    "--offline",
    is_flag=True,
    help="Answer with the GPU-free fingerprint even on a GPU host (never imports torch). "
    "Default on a GPU host: the live fingerprint, as the tuner records it.",
)
@click.option(
    "--perf-model",
    "perf_model",
    envvar="MXDB_MODEL",
    type=click.Path(path_type=Path),
    metavar="MODEL.json",
    help="A performance model (the model.json of 'mxdb model train', or its bundle folder) "
    "that answers shape families the store has not measured here, for bf16 (level "
    "predicted). Default: $MXDB_MODEL.",
)
@db_option
@json_option
@handle_errors
def dispatch_cmd(
    shape: MoEShape,
    routing_trace: Path | None,
    routing_class: str | None,
    fingerprint_file: Path | None,
    policy: str,
    offline: bool,
    perf_model: Path | None,
    db: str | None,
    as_json: bool,
) -> None:
    """Print the config mxdb dispatches for one MoE call, with its level and reason.

    Where nothing measured answers, the answer is the incumbent: the row of the vLLM
    table for this device and shape (shipped or imported; level incumbent, the table
    named), else a fallback: the caller then uses FlagGems' own choice. Exit 0 for any decision, 2 for bad input.  The shape is
    --experts/--hidden/--intermediate/--topk, or --model config.json [--tp N] [--ep N]
    (explicit sizes override the model's).  With --perf-model, a shape family the
    store has not measured in this environment is answered by the performance
    model where its gate admits the choice (level predicted, no entry).
    """
    kw: dict[str, Any] = {
        "routing_trace": routing_trace,
        "routing_class": routing_class,
        "fingerprint_file": fingerprint_file,
        "policy": policy,
        "offline": offline,
    }
    from mxdb.service import dispatch_once

    result = dispatch_once(db, shape, perf_model=perf_model, **kw)
    if as_json:
        emit_json(result)
        return
    d = result
    click.echo(f"shape:      {d['shape']['family']} M={d['shape']['tokens']} {d['shape']['dtype']}")
    click.echo(f"routing:    {d['routing_class']}")
    click.echo(f"level:      {d['level']} (confidence {d['confidence']})")
    click.echo(f"reason:     {d['reason']}: {d['reason_text']}")
    if d["config"] is None:
        click.echo("config:     none (use FlagGems' own choice)")
    else:
        click.echo(f"config:     {d['config_short']}  [{d['config_hash']}]")
        if d.get("source"):
            click.echo(f"entry:      none (the incumbent: {d['source']})")
        elif d["entry_id"] is None:
            click.echo(f"entry:      none (predicted by the performance model {d['perf_model']})")
        else:
            click.echo(
                f"entry:      #{d['entry_id']} (M={d['entry_tokens']}, {d['entry_routing_class']})"
            )


@cli.group("import")
def import_group() -> None:
    """Import entries: vLLM tables (as unverified seeds) or an mxdb export."""


@import_group.command("vllm")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "--hidden", type=int, help="Hidden size H (default: from a known model with this E, N)."
)
@click.option("--topk", type=int, help="Experts per token k (default: from a known model).")
@model_options()
@db_option
@json_option
@handle_errors
def import_vllm_cmd(
    paths: tuple[Path, ...],
    hidden: int | None,
    topk: int | None,
    model_config: Path | None,
    tp: int,
    ep: int,
    db: str | None,
    as_json: bool,
) -> None:
    """Read vLLM fused-MoE tables (files or folders) as imported, unverified entries.

    Imported entries are never dispatched as verified; the tuner uses them as
    search seeds until they are measured in this environment.  Extra launch keys
    (kpack, waves_per_eu, ...) are kept; a row mxdb cannot keep is skipped and named.
    --model config.json [--tp N] [--ep N] names H and k of the table of that model's shard.
    """
    from mxdb.interop.export import import_vllm
    from mxdb.store import Store

    shape = model_dims(model_config, tp, ep)
    with Store.open(db) as store:
        report = import_vllm(store, list(paths), hidden=hidden, topk=topk, shape=shape)
    _print_import(report, as_json)


@import_group.command("flaggems")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--hidden", type=int, help="Hidden size H (default: from a known model).")
@click.option("--topk", type=int, help="Experts per token k (default: from a known model).")
@model_options()
@db_option
@json_option
@handle_errors
def import_flaggems_cmd(
    path: Path,
    hidden: int | None,
    topk: int | None,
    model_config: Path | None,
    tp: int,
    ep: int,
    db: str | None,
    as_json: bool,
) -> None:
    """Read a FlagGems fused_moe_config.yaml's unquantized tables as imported entries."""
    from mxdb.interop.export import import_flaggems
    from mxdb.store import Store

    shape = model_dims(model_config, tp, ep)
    with Store.open(db) as store:
        report = import_flaggems(store, path, shape=shape, hidden=hidden, topk=topk)
    _print_import(report, as_json)


def _print_import(report: Any, as_json: bool) -> None:
    if report.files and report.read == 0:
        raise InvalidInputError(
            f"every one of the {report.files} table file(s) was skipped, nothing was imported: "
            + "; ".join(report.skipped[:5])
            + (f"; ... and {len(report.skipped) - 5} more" if len(report.skipped) > 5 else "")
        )
    if as_json:
        emit_json(report.to_dict())
        return
    click.echo(f"read {report.read} entries from {report.files} files; added {report.added}")
    for why in report.skipped:
        click.echo(f"skipped: {why}", err=True)


@import_group.command("mxdb")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@db_option
@json_option
@handle_errors
def import_mxdb_cmd(path: Path, db: str | None, as_json: bool) -> None:
    """Load an mxdb store export (mxdb export --format mxdb) into the store."""
    from mxdb.interop.export import import_export
    from mxdb.store import Store

    with Store.open(db) as store:
        counts = import_export(store, path)
    if as_json:
        emit_json(counts)
    else:
        click.echo(f"read {counts['read']} entries; added {counts['added']} (duplicates skipped)")


@cli.command("export")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["mxdb", "vllm", "flaggems"]),
    required=True,
    help="mxdb: lossless JSON; vllm: E=..,N=..,device_name=...json files for "
    "$VLLM_TUNED_CONFIG_FOLDER; flaggems: fused_moe_config.yaml.",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    help="Folder (or file for mxdb). Not needed with --install.",
)
@click.option(
    "--fingerprint",
    "fingerprint",
    help="vllm/flaggems: whose rows to write: a fingerprint hash, a fingerprint JSON file or "
    "a recorded name (h200, c500-m0). Default: this host's.",
)
@click.option(
    "--dtype",
    type=click.Choice(["fp16", "bf16"]),
    default="bf16",
    show_default=True,
    help="vllm/flaggems: which dtype's entries to write (their tables carry none).",
)
@click.option(
    "--routing-class",
    type=click.Choice(list(ROUTING_CLASSES)),
    default="uniform",
    show_default=True,
    help="vllm/flaggems: which routing class's entries to write.",
)
@click.option(
    "--status",
    "statuses",
    type=click.Choice(ENTRY_STATUSES),
    multiple=True,
    default=DECIDED_STATUSES,
    show_default=True,
    help="mxdb: entry statuses to export (repeatable).",
)
@click.option(
    "--singles/--no-singles",
    default=True,
    show_default=True,
    help="mxdb: also export the tuner's single-config records (imported, source tune-single), "
    "which the vllm and flaggems exports write where a verified entry is not one FlagGems config.",
)
@click.option(
    "--imported",
    is_flag=True,
    help="vllm: write the imported vLLM tables back as they were read (every device).",
)
@click.option(
    "--merge",
    type=click.Path(dir_okay=False, path_type=Path),
    help="flaggems: merge into this table document, keeping its other devices, keys and "
    "_FALLBACK. mxdb: lay this store over this mxdb export: its entries at the keys this store "
    "holds are replaced, the others kept.",
)
@click.option(
    "--install",
    is_flag=True,
    help="flaggems: write FlagGems' own fused_moe_config.yaml (merged into the installed "
    "one, which is backed up first).",
)
@db_option
@json_option
@handle_errors
def export_cmd(
    fmt: str,
    out: Path | None,
    fingerprint: str | None,
    dtype: str,
    routing_class: str,
    statuses: tuple[str, ...],
    singles: bool,
    imported: bool,
    merge: Path | None,
    install: bool,
    db: str | None,
    as_json: bool,
) -> None:
    """Write the store's rows for mxdb, vLLM or FlagGems to read unchanged.

    vllm/flaggems: one fingerprint's tables, dense (a row at every M vLLM's tuner writes,
    1 ... 4096) and measured (verified uniform configs, FlagGems' config where nothing beat
    it, vLLM's own imported rows elsewhere; never half of a split entry).
    """
    from mxdb.interop.export import ExportOptions, export_store
    from mxdb.store import Store

    if fmt == "vllm" and merge is not None:
        raise UsageError("--merge applies to --format flaggems and mxdb only")
    if fmt != "flaggems" and install:
        raise UsageError("--install applies to --format flaggems only")
    if fmt != "vllm" and imported:
        raise UsageError("--imported applies to --format vllm only")
    if install and out is not None:
        raise UsageError("give --out or --install, not both")
    fp_hash = None
    if fmt in ("vllm", "flaggems") and not imported:
        fp_hash = _fingerprint_hash(fingerprint)
    opts = ExportOptions(
        statuses=statuses,
        singles=singles,
        dtype=dtype,
        routing_class=routing_class,
        fingerprint_hash=fp_hash,
        imported=imported,
        merge=merge,
        install=install,
    )
    with Store.open(db, create=False) as store:
        report = export_store(store, fmt, out, opts)
    if as_json:
        emit_json(report.to_dict())
        return
    where = ", ".join(report.files) if install else f"{len(report.files)} file(s) under {out}"
    click.echo(f"wrote {report.rows or report.entries} rows to {where}")
    if report.fingerprint:
        sources = ", ".join(f"{n} {s}" for s, n in report.row_sources.items()) or "none"
        click.echo(
            f"fingerprint {report.fingerprint} ({report.device_name or 'unknown device'}); "
            f"rows by source: {sources}"
        )
    if report.backup:
        click.echo(f"previous table backed up to {report.backup}")
    if fmt == "vllm" and report.files:
        click.echo(f"point vLLM at it: export VLLM_TUNED_CONFIG_FOLDER={Path(str(out)).resolve()}")
    for line in [*report.notes, *report.lossy]:
        click.echo(f"note: {line}", err=True)


def _fingerprint_hash(value: str | None) -> str:
    """A fingerprint hash from --fingerprint: a hash, a JSON file or a recorded name."""
    import re

    from mxdb.dispatcher import current_fingerprint
    from mxdb.fingerprint import RECORDED, load_fingerprint, recorded

    if value is None:
        return current_fingerprint().hash
    if value in RECORDED:
        return recorded(value).hash
    if re.fullmatch(r"[0-9a-f]{16}", value):
        return value
    return load_fingerprint(value).hash


@cli.group("db")
def db_group() -> None:
    """Inspect the store: its URL, schema revision and what it holds."""


@db_group.command("info")
@db_option
@json_option
@handle_errors
def db_info_cmd(db: str | None, as_json: bool) -> None:
    """Print the store's URL, schema revision and entry counts by status."""
    from mxdb.service import store_info

    info = store_info(db)
    if as_json:
        emit_json(info)
    else:
        for key, value in info.items():
            click.echo(f"{key}: {value}")
