"""`kda-patches` dispatch: delegated subcommands own their options; `run` hands over to the launcher."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kda_patches import cli


def test_delegated_subcommands_get_their_own_arguments(monkeypatch):
    received = {}

    def fake_delegate(module, argv):
        received[module] = argv
        return 3

    monkeypatch.setattr(cli, "command_delegate", fake_delegate)
    assert cli.main(["bench", "state-copy", "--help"]) == 3
    assert cli.main(["regress", "--workload", "x", "--json"]) == 3
    assert received == {"kda_patches.bench": ["state-copy", "--help"],
                        "kda_patches.regress.cli": ["--workload", "x", "--json"]}


@pytest.mark.parametrize("command", ["bench", "regress"])
def test_delegated_help_reaches_the_subcommand_parser(command):
    result = subprocess.run([sys.executable, "-m", "kda_patches", command, "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: kda-patches {command}")


def test_run_without_command_explains_usage(capsys):
    assert cli.main(["run"]) == 2
    assert "after '--'" in capsys.readouterr().err


def test_kda_run_execs_the_command_in_place():
    script = os.path.join(os.path.dirname(sys.executable), "kda-run")
    result = subprocess.run([script, sys.executable, "-c", "import os, sys; print(os.getpid())"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().isdigit()
