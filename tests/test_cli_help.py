"""Every CLI command has help text, and --help works for each (driven through the real CLI)."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

import mxdb.cli
from mxdb.cli.app import cli


def _walk(
    group: click.Group, prefix: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], click.Command]]:
    found: list[tuple[tuple[str, ...], click.Command]] = []
    for name, cmd in sorted(group.commands.items()):
        path = (*prefix, name)
        found.append((path, cmd))
        if isinstance(cmd, click.Group):
            found.extend(_walk(cmd, path))
    return found


COMMANDS = _walk(cli)


def test_the_documented_commands_exist() -> None:
    names = {" ".join(p) for p, _ in COMMANDS}
    for required in (
        "dispatch",
        "trace",
        "audit",
        "export",
        "import",
        "import vllm",
        "import mxdb",
        "fingerprint",
        "check-config",
        "report",
        "sign",
        "tune",
        "model",
        "model train",
        "model predict",
    ):
        assert required in names, f"mxdb {required} is missing; have {sorted(names)}"


@pytest.mark.parametrize("path, cmd", COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_command_has_help(path: tuple[str, ...], cmd: click.Command) -> None:
    assert cmd.help and len(cmd.help.strip()) > 20, f"mxdb {' '.join(path)} has no help text"
    result = CliRunner().invoke(cli, [*path, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage: " in result.output
    first_line = cmd.help.strip().splitlines()[0]
    assert first_line[:30] in " ".join(result.output.split())
    for param in cmd.params:
        if isinstance(param, click.Option) and not param.hidden:
            assert param.help or (param.is_flag and param.name in ("help",)), (
                f"option {param.opts} of mxdb {' '.join(path)} has no help"
            )


def test_top_level_help_and_version_via_subprocess() -> None:
    out = subprocess.run([sys.executable, "-m", "mxdb", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "dispatch" in out.stdout
    ver = subprocess.run(
        [sys.executable, "-m", "mxdb", "--version"], capture_output=True, text=True
    )
    assert ver.returncode == 0 and mxdb.__version__ in ver.stdout


def test_usage_error_exits_2() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mxdb", "dispatch", "--experts", "8"], capture_output=True, text=True
    )
    assert out.returncode == 2
    assert "Missing option" in out.stderr
