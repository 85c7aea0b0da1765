"""The root click group, shared options and the error-to-exit-code mapping."""

from __future__ import annotations

import functools
import json
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

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


#: --model's help where the command gives a shape (dispatch, the imports).
MODEL_HELP = "A Hugging Face config.json (or its folder) giving the per-shard MoE shape."


def model_options(model_help: str = MODEL_HELP) -> Callable[[F], F]:
    """--model config.json, --tp N, --ep N: a model's per-shard MoE shape."""

    def deco(fn: F) -> F:
        fn = click.option(
            "--ep",
            type=int,
            default=1,
            show_default=True,
            help="Expert-parallel ranks (vLLM's --enable-expert-parallel): E/ep whole experts "
            "a rank.",
        )(fn)
        fn = click.option(
            "--tp", type=int, default=1, show_default=True, help="Tensor-parallel ranks."
        )(fn)
        return click.option(
            "--model", "model_config", type=click.Path(path_type=Path), help=model_help
        )(fn)

    return deco


def model_dims(model_config: Path | None, tp: int, ep: int) -> tuple[int, int, int, int] | None:
    """(E, H, N, k) of one shard of --model, or None without it."""
    from mxdb.errors import UsageError

    if model_config is None:
        if tp != 1 or ep != 1:
            raise UsageError("--tp and --ep shard a model given with --model")
        return None
    from mxdb.modelconfig import load as load_model

    e, h, n, k = load_model(model_config, tp=tp, ep=ep).dims()
    return e, h, n, min(k, e)


def shape_options(*, model: bool = False, dtypes: Sequence[str] | None = None) -> Callable[[F], F]:
    """-E/-H/-I/-k/-M/--dtype (with ``model``, also --model/--tp/--ep): the command is called
    with ``shape``, the built :class:`~mxdb.shapes.MoEShape`, in their place.

    Without ``model`` the four sizes are required; with it, a size not given comes from the
    model's shard.  ``dtypes`` limits --dtype to those choices (default: any dtype the shape
    accepts).  A bad or missing shape raises (a usage error: exit 2) before the command runs.
    """

    def deco(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kw: Any) -> Any:
            from mxdb.errors import UsageError
            from mxdb.shapes import MoEShape

            sizes = [kw.pop(k) for k in ("experts", "hidden", "intermediate", "topk")]
            if model:
                dims = model_dims(kw.pop("model_config"), kw.pop("tp"), kw.pop("ep"))
                if dims is not None:
                    sizes = [s if s is not None else d for s, d in zip(sizes, dims, strict=True)]
                if any(s is None for s in sizes):
                    raise UsageError(
                        "give the shape: --experts, --hidden, --intermediate and --topk, or --model"
                    )
            e, h, i, k = sizes
            kw["shape"] = MoEShape(e, h, i, k, kw.pop("tokens"), kw.pop("dtype"))
            return fn(*args, **kw)

        w: Any = wrapper
        w = click.option(
            "--dtype",
            type=click.Choice(list(dtypes)) if dtypes else str,
            default="bf16",
            show_default=True,
            help="Element type of activations and weights"
            + ("." if dtypes else ": fp16, bf16 or fp32."),
        )(w)
        w = click.option("--tokens", "-M", type=int, required=True, help="Tokens in the batch M.")(
            w
        )
        if model:
            w = model_options()(w)
        required = not model
        for name, short, what in reversed(_SIZES):
            w = click.option(name, short, type=int, required=required, help=what)(w)
        return cast(F, w)

    return deco


_SIZES = (
    ("--experts", "-E", "Number of experts E."),
    ("--hidden", "-H", "Hidden size H."),
    ("--intermediate", "-I", "Per-expert intermediate size I."),
    ("--topk", "-k", "Experts per token k."),
)
