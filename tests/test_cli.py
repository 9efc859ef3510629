"""The `memfit` command: usage, dispatch to each subcommand's module, exit 2 on an unknown command."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from memfit.cli import COMMANDS, main


def test_no_command_or_help_prints_every_command(capsys):
    for argv in ([], ["--help"], ["-h"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: memfit <command>")
        assert all(name in out for name in COMMANDS)


def test_unknown_command_exits_2_naming_it(capsys):
    assert main(["estmate", "--model", "x"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'estmate'" in err and "usage: memfit" in err


def test_the_console_entry_exits_with_the_command_status():
    res = subprocess.run([sys.executable, "-m", "memfit.cli", "nope"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "unknown command 'nope'" in res.stderr


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_points_at_a_function_taking_argv(name):
    module, func, help_ = COMMANDS[name]
    assert callable(getattr(importlib.import_module(module), func)), f"{module}.{func}"
    assert help_


def test_dispatch_passes_the_remaining_arguments_and_returns_the_status(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setitem(COMMANDS, "echo", ("memfit.cli", "_echo_for_test", "test"))
    monkeypatch.setattr("memfit.cli._echo_for_test", lambda argv: seen.append(argv) or 7, raising=False)
    assert main(["echo", "--a", "1"]) == 7
    assert seen == [["--a", "1"]]
    # a real subcommand: compare-results over two empty trees is a difference (exit 1), not a crash
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert main(["compare-results", str(tmp_path / "a"), str(tmp_path / "b")]) == 1


def test_a_subcommands_own_help_names_it(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["launch", "--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("usage: memfit launch")
