"""CLI commands for drift governance: ``mxdb drift check``, ``reverify`` and ``guard``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from mxdb.cli.app import cli, db_option, emit_json, handle_errors, json_option

_POLICY = click.option(
    "--policy",
    type=click.Choice(["strict", "device"]),
    default="strict",
    show_default=True,
    help="Fingerprint match policy, as the dispatcher's: strict (every component) or device.",
)


#: Where a drift command measures: the GPU (mxdb.kernels) or the analytic fake backend.
backend_option = click.option(
    "--backend",
    "backend_name",
    type=click.Choice(["gpu", "fake"]),
    default="gpu",
    show_default=True,
    help="Where to measure: the GPU (mxdb.kernels) or the analytic fake backend (demos, CI).",
)


@cli.group("drift")
def drift_group() -> None:
    """Find entries made stale by an environment change, and guard against performance drift."""


@drift_group.command("check")
@db_option
@click.option(
    "--fingerprint",
    "fingerprint_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Current fingerprint JSON (mxdb fingerprint --json); default: this environment.",
)
@click.option(
    "--out",
    "out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    metavar="WORKLOAD.yaml",
    help="Write a re-tune workload for the affected shapes, tokens, dtypes and routings.",
)
@_POLICY
@click.option(
    "--mark",
    is_flag=True,
    help="Mark the drifted entries stale in the store. Without it the check is a dry run: "
    "it lists what would go stale and writes nothing to the store.",
)
@click.option("--dry-run", is_flag=True, hidden=True, help="The default; kept for old scripts.")
@click.option(
    "--offline",
    is_flag=True,
    help="Judge with the GPU-free fingerprint even on a GPU host (it cannot stale GPU entries).",
)
@json_option
@handle_errors
def drift_check_cmd(
    db: str | None,
    fingerprint_file: Path | None,
    out: Path | None,
    policy: str,
    mark: bool,
    dry_run: bool,
    offline: bool,
    as_json: bool,
) -> None:
    """List entries of changed environments (every op kind); mark them stale with --mark.

    A current fingerprint without GPU facts (a CPU-only host, --offline) cannot judge entries
    measured on a GPU: they are listed as such and left alone.  Exit 0 when nothing drifted,
    1 when entries were (or, without --mark, would be) marked.
    """
    from mxdb.errors import UsageError
    from mxdb.runtime.drift import run_check

    if mark and dry_run:
        raise UsageError("give --mark or --dry-run, not both")
    report = run_check(
        db, fingerprint_file, policy=policy, mark=mark, workload_out=out, offline=offline
    )
    if as_json:
        emit_json(report)
    else:
        _print_check(report, not mark)
    if report["would_mark"]:
        sys.exit(1)


def _print_check(report: dict[str, Any], dry_run: bool) -> None:
    click.echo(f"current fingerprint {report['fingerprint']} (policy {report['policy']})")
    if not report["drifted"] and not report["cannot_judge"]:
        click.echo("no drift: every stored fingerprint matches")
    for d in report["drifted"]:
        click.echo(f"fingerprint {d['fingerprint_hash']}: {len(d['entries'])} verified entries")
        for c in d["changes"]:
            tag = "breaks" if c["component"] in d["breaking"] else "tolerated"
            click.echo(f"  {c['component']}: {c['old']} -> {c['new']} ({tag})")
    for d in report["cannot_judge"]:
        click.echo(
            f"fingerprint {d['fingerprint_hash']}: {len(d['entries'])} entries not judged: "
            f"{d['reason']}"
        )
    verb = "would mark" if dry_run else "marked"
    n = report["would_mark"] if dry_run else report["marked"]
    click.echo(f"{verb} {n} entries stale; {report['already_stale']} were already stale")
    if dry_run and n:
        click.echo("dry run: nothing was written; pass --mark to mark them")
    if report["decode_cases"]:
        click.echo(f"{len(report['decode_cases'])} decode-op cases need re-tuning")
    if report["workload_path"]:
        click.echo(f"re-tune workload written to {report['workload_path']}")


@drift_group.command("reverify")
@db_option
@backend_option
@click.option(
    "--entry",
    "entry_ids",
    type=int,
    multiple=True,
    help="Re-verify only this stale entry (repeatable). Default: every stale entry.",
)
@click.option(
    "--reps",
    type=click.IntRange(min=1),
    default=20,
    show_default=True,
    help="Timed samples per config.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Routing and input seed.")
@click.option(
    "--out",
    "out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    metavar="EVIDENCE.json",
    help="Also write the report with every raw sample to this file.",
)
@json_option
@handle_errors
def drift_reverify_cmd(
    db: str | None,
    backend_name: str,
    entry_ids: tuple[int, ...],
    reps: int,
    seed: int,
    out: Path | None,
    as_json: bool,
) -> None:
    """Re-measure stale entries in this environment: each is verified again or rejected.

    Each verdict is a new entry under the current fingerprint (the stale one stays, as the
    record of its old environment, and names the verdict); every timing is stored as a
    measurement.  Exit 0 when every re-measured entry was verified again, 1 when any was
    rejected or skipped.
    """
    from mxdb.runtime.drift import run_reverify

    report = run_reverify(
        db,
        backend_name,
        reps=reps,
        seed=seed,
        entry_ids=list(entry_ids) or None,
        evidence_out=out,
    )
    if as_json:
        emit_json(report)
    else:
        click.echo(
            f"re-measured stale entries on {report['backend']} in {report['fingerprint']}: "
            f"{report['verified']} verified, {report['baseline']} baseline, "
            f"{report['rejected']} rejected, {report['skipped']} skipped"
        )
        for r in report["results"]:
            new = f" -> entry {r['new_entry_id']}" if r["new_entry_id"] is not None else ""
            click.echo(
                f"  entry {r['entry_id']} {r['op']} {r['family']} {r['dtype']} M={r['tokens']} "
                f"{r['routing_class']}: {r['verdict']}{new} ({r['reason']})"
            )
        if report["evidence_path"]:
            click.echo(f"evidence written to {report['evidence_path']}")
    if report["rejected"] or report["skipped"]:
        sys.exit(1)


@drift_group.command("guard")
@db_option
@click.option(
    "--threshold",
    type=click.FloatRange(min=0, min_open=True),
    default=0.05,
    show_default=True,
    help="Flag an entry whose speedup over FlagGems' choice moved more than this fraction.",
)
@backend_option
@click.option(
    "--max-shapes",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Guard at most this many entries, spread over families and token counts.",
)
@click.option(
    "--reps",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    help="Timed samples per guard entry.",
)
@click.option("--mark", is_flag=True, help="Mark entries that got slower as stale.")
@_POLICY
@json_option
@handle_errors
def drift_guard_cmd(
    db: str | None,
    threshold: float,
    backend_name: str,
    max_shapes: int,
    reps: int,
    mark: bool,
    policy: str,
    as_json: bool,
) -> None:
    """Re-measure guard entries and flag performance drift no version string shows.

    Exit 0 when every guard is within the threshold, 1 when any was flagged.
    """
    from mxdb.runtime.drift import run_guard

    report = run_guard(
        db,
        backend_name,
        threshold=threshold,
        policy=policy,
        max_shapes=max_shapes,
        reps=reps,
        mark=mark,
    )
    if as_json:
        emit_json(report)
    else:
        click.echo(
            f"{report['guards']} guard entries on {report['backend']}, "
            f"threshold {report['threshold']:.1%}: {report['flagged']} flagged"
        )
        for r in report["results"]:
            click.echo(
                f"  entry {r['entry_id']} {r['family']} {r['dtype']} M={r['tokens']} "
                f"{r['routing_class']}: {r['status']} ({_guard_figures(r)})"
            )
    if report["flagged"]:
        sys.exit(1)


def _guard_figures(r: dict[str, Any]) -> str:
    def x(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}x"

    return (
        f"speedup over FlagGems {x(r.get('speedup'))} vs recorded {x(r.get('recorded_speedup'))}, "
        f"drift {x(r.get('drift'))}, time {x(r.get('ratio'))} recorded"
    )
