"""CLI commands for routing traces, environment fingerprints and config resource checks."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from mxdb.cli.app import cli, emit_json, handle_errors, json_option, shape_options
from mxdb.errors import ConfigError
from mxdb.shapes import MoEShape


@cli.command("trace")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--experts",
    "-E",
    type=click.IntRange(min=1),
    required=True,
    help="Number of experts E (ids must be in [0, E)).",
)
@click.option(
    "--align-block",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="moe_align_block_size block for the padding ratio.",
)
@json_option
@handle_errors
def trace_cmd(file: Path, experts: int, align_block: int, as_json: bool) -> None:
    """Print the routing features and class of a top-k trace FILE (.json or .npy).

    FILE holds the [M, k] expert ids of a batch: a JSON list of lists, a JSON
    object {"topk_ids": [[...]]}, or a .npy array.
    """
    from mxdb.routing import analyze_trace

    feats = analyze_trace(file, experts, align_block)
    if as_json:
        emit_json(feats.to_dict())
        return
    rows = [
        ("routing class", feats.routing_class),
        ("tokens M", feats.tokens),
        ("top-k k", feats.topk),
        ("experts E", feats.experts),
        ("entropy / ln E", f"{feats.entropy_norm:.4f}"),
        ("CV of counts", f"{feats.cv:.4f}"),
        ("empty experts", f"{feats.empty_ratio:.2%}"),
        ("max load share", f"{feats.max_share:.2%}"),
        (f"padding (block {feats.align_block})", f"{feats.padding_ratio:.4f}"),
        ("trace hash", feats.trace_hash),
        ("counts", " ".join(str(c) for c in feats.counts)),
    ]
    _print_rows(f"trace {file}", rows)


@cli.command("fingerprint")
@click.option(
    "--diff",
    "other",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    metavar="OTHER.json",
    help="Compare with a recorded fingerprint (from `mxdb fingerprint --json`); "
    "exit 1 when components differ.",
)
@click.option(
    "--offline",
    is_flag=True,
    help="The GPU-free fingerprint even on a GPU host (never imports torch).",
)
@json_option
@handle_errors
def fingerprint_cmd(other: Path | None, offline: bool, as_json: bool) -> None:
    """Print this environment's fingerprint and its hash.

    On a GPU host it is the live fingerprint (device facts read through torch), the one the
    tuner records; without a GPU, or with --offline, only software components are known and
    the others are marked absent.  With --diff, name the components that changed since
    OTHER.json.
    """
    from mxdb.hostinfo import describe

    doc = describe(other, offline=offline)
    if as_json:
        emit_json(doc)
    else:
        fp = doc["fingerprint"]
        rows: list[tuple[str, Any]] = [
            (k, "absent" if v is None else v) for k, v in fp.items() if k != "hash"
        ]
        rows.append(("hash", fp["hash"]))
        # recorded data outside the hash (the FlagGems config table's hash, when installed)
        rows.append(("flaggems_moe_table", doc["data"].get("flaggems_moe_table", "absent")))
        rows.append(("source", f"{doc['source']} ({doc['note']})"))
        _print_rows("fingerprint", rows)
        if other is not None:
            changes = doc["changes"]
            click.echo(f"\nagainst {other} (hash {doc['recorded_hash']}):")
            if not changes:
                click.echo("  no component changed")
            for c in changes:
                old = "absent" if c["old"] is None else c["old"]
                new = "absent" if c["new"] is None else c["new"]
                click.echo(f"  changed {c['component']}: {old} -> {new}")
    if other is not None and doc["changes"]:
        sys.exit(1)


@cli.command("check-config")
@click.option(
    "--profile",
    "profile",
    required=True,
    help="Device profile: c500, h200, h100, a100, a device name, or live (needs a GPU).",
)
@shape_options()
@click.option(
    "--config",
    "config",
    required=True,
    metavar="JSON",
    help="The config: JSON text (vLLM-style flat dict or {gemm1, gemm2, align_block}) "
    "or a path to a .json file.",
)
@json_option
@handle_errors
def check_config_cmd(
    profile: str,
    shape: MoEShape,
    config: str,
    as_json: bool,
) -> None:
    """Estimate shared memory and registers of a fused-MoE config, without compiling.

    Exit 0 when both GEMMs fit the device, 1 when one does not, 2 for bad input.
    """
    from mxdb.resources import check_config

    result = check_config(_config_text(config), shape, profile=profile)
    if as_json:
        emit_json(result.to_dict())
    else:
        s = result.shape
        click.echo(
            f"profile {result.profile}; shape E={s['experts']} H={s['hidden']} "
            f"I={s['intermediate']} k={s['topk']} M={s['tokens']} {s['dtype']}"
        )
        for est in (result.gemm1, result.gemm2):
            verdict = "fits" if est.fits else "DOES NOT FIT"
            click.echo(
                f"GEMM{est.gemm_index} {est.config}: smem {est.smem_bytes:,} / "
                f"{est.smem_limit:,} B ({est.smem_buffers} buffers), ~{est.regs_per_thread_est} "
                f"regs/thread (accumulator {est.acc_regs_per_thread}), {est.threads} threads: "
                f"{verdict}"
            )
            for r in est.reasons:
                click.echo(f"  reason: {r}")
            for w in est.warnings:
                click.echo(f"  warning: {w}")
        click.echo("fits" if result.fits else "does not fit")
    sys.exit(0 if result.fits else 1)


def _config_text(value: str) -> str:
    text = value.strip()
    if text.startswith("{"):
        return text
    from mxdb.fileio import MAX_SMALL_BYTES, read_text

    path = Path(value)
    if not path.exists():
        raise ConfigError(
            f"--config {value!r} is neither JSON text (starting with '{{') nor an existing file"
        )
    return read_text(path, limit=MAX_SMALL_BYTES, what="--config file", error=ConfigError)


def _print_rows(title: str, rows: list[tuple[str, Any]]) -> None:
    width = max(len(k) for k, _ in rows)
    click.echo(title)
    for key, value in rows:
        click.echo(f"  {key.ljust(width)}  {value}")
