"""CLI commands of the evidence area: ``audit``, ``report``, ``sign``, ``keygen``."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from mxdb.cli.app import cli, emit_json, handle_errors, json_option


@cli.command("audit")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "--trusted-keys",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Folder of *.pub Ed25519 keys; every bundle must then carry a valid signature by one "
    "of them, checked before anything else is read.",
)
@json_option
@handle_errors
def audit_cmd(paths: tuple[Path, ...], trusted_keys: Path | None, as_json: bool) -> None:
    """Audit evidence bundles: re-hash every file, recompute every claimed figure.

    Each PATH is a bundle folder or a folder holding bundles (found by their manifest.json).
    Exit 0 when nothing is found, 1 on any finding, 2 on a usage error.
    """
    from mxdb.audit import AuditOptions, audit_paths

    result = audit_paths(paths, AuditOptions(trusted_keys=trusted_keys))
    if as_json:
        emit_json(result.to_dict())
    else:
        for f in result.findings:
            click.echo(f.line())
    runs = sum(b.runs for b in result.bundles)
    verdict = "ok" if result.ok else "FAILED"
    click.echo(
        f"mxdb audit: {verdict}: {len(result.bundles)} bundle(s), {runs} run(s), "
        f"{len(result.findings)} finding(s)",
        err=True,
    )
    sys.exit(0 if result.ok else 1)


@cli.command("report")
@click.argument("bundle", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(path_type=Path, file_okay=False),
    help="Folder for report.md, report.json and the PNG plots.",
)
@click.option("--no-plots", is_flag=True, help="Skip the PNG plots (no matplotlib needed).")
@json_option
@handle_errors
def report_cmd(bundle: Path, out_dir: Path, no_plots: bool, as_json: bool) -> None:
    """Write a bundle's milestone summary as Markdown, JSON and PNG plots.

    Every figure is recomputed from the bundle's raw samples; failures are listed.
    """
    from mxdb.report import write_report

    written = write_report(bundle, out_dir, plots=not no_plots)
    if as_json:
        emit_json({"files": [str(p) for p in written]})
    else:
        for p in written:
            click.echo(str(p))


@cli.command("sign")
@click.argument("bundle", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option(
    "--key",
    "key_file",
    required=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="Ed25519 private key (PEM), from mxdb keygen.",
)
@handle_errors
def sign_cmd(bundle: Path, key_file: Path) -> None:
    """Sign a bundle's manifest with Ed25519 (writes signatures/<key_id>.sig)."""
    from mxdb.signing import sign_bundle

    click.echo(str(sign_bundle(bundle, key_file)))


@cli.command("keygen")
@click.option(
    "--out",
    "out",
    required=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="Private key file to write; the public key goes to FILE.pub.",
)
@handle_errors
def keygen_cmd(out: Path) -> None:
    """Make an Ed25519 key pair for signing evidence bundles."""
    from mxdb.signing import keygen

    for p in keygen(out):
        click.echo(str(p))
