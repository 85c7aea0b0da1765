"""The root click group, shared options and the error-to-exit-code mapping."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from mxdb import __version__
from mxdb.errors import MxdbError

F = TypeVar("F", bound=Callable[..., Any])

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@click.group(context_settings=CONTEXT_SETTINGS)
@click.version_option(__version__, prog_name="mxdb")
def cli() -> None:
    """mxdb: verified, routing-aware Triton kernel configs for fused-MoE layers.

    Tune on a GPU host (mxdb tune), audit committed evidence on any machine
    (mxdb audit), and answer dispatches from the store (mxdb dispatch).
    The store is a SQLAlchemy URL given by --db or MXDB_DB (default: a
    SQLite file in the user's cache directory).
    """


def handle_errors(fn: F) -> F:
    """Turn MxdbError into a one-line message on stderr and its exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except MxdbError as exc:
            click.echo(f"mxdb: error: {exc}", err=True)
            sys.exit(exc.exit_code)

    return wrapper  # type: ignore[return-value]


def db_option(fn: F) -> F:
    """The --db option: a SQLAlchemy URL, or MXDB_DB, or the default cache file."""
    return click.option(
        "--db",
        "db",
        envvar="MXDB_DB",
        default=None,
        metavar="URL",
        help="Store URL (SQLAlchemy; e.g. sqlite:///mxdb.sqlite or postgresql+psycopg://...). "
        "Default: $MXDB_DB, else a SQLite file in the user's cache directory.",
    )(fn)


def json_option(fn: F) -> F:
    return click.option(
        "--json", "as_json", is_flag=True, help="Print machine-readable JSON on stdout."
    )(fn)


def emit_json(data: Any) -> None:
    """Write ``data`` as indented JSON to stdout."""
    click.echo(json.dumps(data, indent=2, sort_keys=False, default=str))


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    cli.main(args=argv, prog_name="mxdb")
