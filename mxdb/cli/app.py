"""The root click group, shared options and the error-to-exit-code mapping."""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click

from mxdb.errors import MxdbError
from mxdb.version import __version__

F = TypeVar("F", bound=Callable[..., Any])

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


#: Exit codes: 0 success; 1 findings or failure; 2 usage errors and malformed input.
EXIT_FAILURE = 1
EXIT_USAGE = 2
_GPU_PACKAGES = ("torch", "triton", "flag_gems")


def _wants(args: list[str], flag: str) -> bool:
    """Whether ``flag`` was given before a ``--`` (the parse itself may have failed)."""
    for a in args:
        if a == "--":
            return False
        if a == flag:
            return True
    return False


def _error_doc(kind: str, message: str, code: int) -> dict[str, Any]:
    return {"error": {"type": kind, "message": message, "exit_code": code}}


def _report(args: list[str], kind: str, message: str, code: int) -> None:
    """The one place an error leaves the CLI: JSON on stdout with --json, else a line on stderr."""
    if _wants(args, "--json"):
        click.echo(json.dumps(_error_doc(kind, message, code), indent=2))
    else:
        click.echo(f"mxdb: error: {message}", err=True)


def _classify(exc: BaseException) -> tuple[str, str, int]:
    """(type name, message, exit code) of an exception that reached the CLI."""
    from mxdb.errors import OutputError

    if isinstance(exc, MxdbError):
        return type(exc).__name__, str(exc), exc.exit_code
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] in _GPU_PACKAGES:
        return (
            "GpuUnavailableError",
            f"this command needs {exc.name}, which is not installed: install the GPU extra "
            "(pip install 'mxdb[gpu]'), or for mxdb tune use --backend fake",
            EXIT_FAILURE,
        )
    if isinstance(exc, OSError):
        from mxdb.fileio import output_error

        path = Path(exc.filename) if exc.filename else Path("a file")
        err: OutputError = output_error(path, exc, verb="use")
        return type(err).__name__, str(err), err.exit_code
    if isinstance(exc, MemoryError):
        return "MemoryError", "out of memory; pass a smaller input", EXIT_FAILURE
    if isinstance(exc, RecursionError):
        return "InvalidInputError", "input nested too deeply to process", EXIT_USAGE
    return (
        "InternalError",
        f"unexpected {type(exc).__name__}: {exc}; this is a bug in mxdb: please report it "
        "with the command line (run again with --debug for a traceback)",
        EXIT_FAILURE,
    )


class MxdbGroup(click.Group):
    """The root group: every exception that reaches it becomes a message and an exit code.

    Usage errors and malformed input exit 2, failures 1; with ``--json`` the error is a
    JSON object ``{"error": {"type", "message", "exit_code"}}`` on stdout; a traceback is
    printed only under ``--debug`` (or ``MXDB_DEBUG=1``).
    """

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        debug = _wants(argv, "--debug") or os.environ.get("MXDB_DEBUG", "") not in ("", "0")
        if _wants(argv, "--debug"):  # accepted anywhere before "--", not only before the command
            cut = argv.index("--") if "--" in argv else len(argv)
            argv = [a for a in argv[:cut] if a != "--debug"] + argv[cut:]
        try:
            rv = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.exceptions.Abort:
            _report(argv, "Aborted", "aborted", EXIT_FAILURE)
            sys.exit(EXIT_FAILURE)
        except click.ClickException as exc:
            code = EXIT_USAGE if exc.exit_code not in (0, 1) else exc.exit_code
            if _wants(argv, "--json"):
                kind = "UsageError" if code == EXIT_USAGE else "Error"
                _report(argv, kind, exc.format_message(), code)
            else:
                exc.show()
            sys.exit(code)
        except KeyboardInterrupt:
            _report(argv, "Interrupted", "interrupted", 130)
            sys.exit(130)
        except Exception as exc:
            if debug:
                traceback.print_exc()
            kind, message, code = _classify(exc)
            _report(argv, kind, message, code)
            sys.exit(code)
        code = rv if isinstance(rv, int) else 0
        if not standalone_mode:
            return rv
        sys.exit(code)


@click.group(cls=MxdbGroup, context_settings=CONTEXT_SETTINGS)
@click.version_option(__version__, prog_name="mxdb")
@click.option(
    "--debug",
    is_flag=True,
    help="Print a traceback with any error (also MXDB_DEBUG=1).",
)
def cli(debug: bool) -> None:
    """mxdb: verified, routing-aware Triton kernel configs for fused-MoE layers.

    Tune on a GPU host (mxdb tune), audit committed evidence on any machine
    (mxdb audit), and answer dispatches from the store (mxdb dispatch).
    The store is a SQLAlchemy URL given by --db or MXDB_DB (default: a
    SQLite file in the user's cache directory).

    Exit codes: 0 success; 1 findings or failure; 2 usage errors and malformed
    input.  With --json, errors are a JSON object on stdout.
    """


def handle_errors(fn: F) -> F:
    """Mark a command as reporting its errors through the root group (kept for readability).

    The root group (``MxdbGroup``) turns every exception into a message and exit code.
    """
    return fn


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
