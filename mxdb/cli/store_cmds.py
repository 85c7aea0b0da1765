"""CLI commands over the store: dispatch, import, export, db info."""

from __future__ import annotations

from pathlib import Path

import click

from mxdb.cli.app import cli, db_option, emit_json, handle_errors, json_option
from mxdb.models import ROUTING_CLASSES


@cli.command("dispatch")
@click.option("--experts", "-E", type=int, required=True, help="Number of experts E.")
@click.option("--hidden", "-H", type=int, required=True, help="Hidden size H.")
@click.option(
    "--intermediate", "-I", type=int, required=True, help="Per-expert intermediate size I."
)
@click.option("--topk", "-k", type=int, required=True, help="Experts per token k.")
@click.option("--tokens", "-M", type=int, required=True, help="Tokens in the batch M.")
@click.option(
    "--dtype",
    type=click.Choice(["fp16", "bf16"]),
    default="bf16",
    show_default=True,
    help="Element type of activations and weights.",
)
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
@db_option
@json_option
@handle_errors
def dispatch_cmd(
    experts: int,
    hidden: int,
    intermediate: int,
    topk: int,
    tokens: int,
    dtype: str,
    routing_trace: Path | None,
    routing_class: str | None,
    fingerprint_file: Path | None,
    policy: str,
    offline: bool,
    db: str | None,
    as_json: bool,
) -> None:
    """Print the config mxdb dispatches for one MoE call, with its level and reason.

    A fallback (no confident answer) is a valid answer: the caller then uses
    FlagGems' own choice. Exit 0 for any decision, 2 for bad input.
    """
    from mxdb.service import dispatch_once

    result = dispatch_once(
        db,
        experts=experts,
        hidden=hidden,
        intermediate=intermediate,
        topk=topk,
        tokens=tokens,
        dtype=dtype,
        routing_trace=routing_trace,
        routing_class=routing_class,
        fingerprint_file=fingerprint_file,
        policy=policy,
        offline=offline,
    )
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
@db_option
@json_option
@handle_errors
def import_vllm_cmd(
    paths: tuple[Path, ...], hidden: int | None, topk: int | None, db: str | None, as_json: bool
) -> None:
    """Read vLLM fused-MoE tables (files or folders) as imported, unverified entries.

    Imported entries are never dispatched as verified; the tuner uses them as
    search seeds until they are measured in this environment.
    """
    from mxdb.interop.export import import_vllm
    from mxdb.store import Store

    with Store.open(db) as store:
        report = import_vllm(store, list(paths), hidden=hidden, topk=topk)
    if as_json:
        emit_json(report.to_dict())
    else:
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
    help="mxdb: lossless JSON; vllm: E=..,N=..,device_name=...json files; "
    "flaggems: fused_moe_config.yaml.",
)
@click.option(
    "--out", required=True, type=click.Path(path_type=Path), help="Folder (or file for mxdb)."
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
    multiple=True,
    default=("verified", "baseline"),
    show_default=True,
    help="Entry statuses to export (repeatable); vllm/flaggems tables take verified ones only.",
)
@db_option
@json_option
@handle_errors
def export_cmd(
    fmt: str,
    out: Path,
    dtype: str,
    routing_class: str,
    statuses: tuple[str, ...],
    db: str | None,
    as_json: bool,
) -> None:
    """Write the store's best verified configs for mxdb, vLLM or FlagGems to read unchanged."""
    from mxdb.interop.export import ExportOptions, export_store
    from mxdb.store import Store

    opts = ExportOptions(statuses=statuses, dtype=dtype, routing_class=routing_class)
    with Store.open(db) as store:
        report = export_store(store, fmt, out, opts)
    if as_json:
        emit_json(report.to_dict())
    else:
        click.echo(f"wrote {report.entries} entries to {len(report.files)} file(s) under {out}")
        for line in report.lossy:
            click.echo(f"lossy: {line}", err=True)


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
