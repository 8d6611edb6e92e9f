"""The `batchpilot` entry point: every subcommand answers --help, bad input is refused."""

import subprocess
import sys

import pytest
from batchpilot_server.cli import SUBCOMMANDS


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "batchpilot_server.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_subcommand_prints_its_help(command: str) -> None:
    result = run_cli(command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: batchpilot {command}")


def test_no_command_prints_usage_and_fails() -> None:
    result = run_cli()
    assert result.returncode == 2
    assert "usage: batchpilot <command>" in result.stdout


def test_unknown_command_is_refused_with_the_list() -> None:
    result = run_cli("servee")
    assert result.returncode == 2
    assert "unknown command 'servee'" in result.stderr
    assert "serve" in result.stderr


def test_operator_commands_never_import_torch() -> None:
    probe = (
        "import sys, batchpilot_operator.main, batchpilot_operator.tune_local, "
        "batchpilot_operator.autotune; print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
