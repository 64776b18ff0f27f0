"""The front door, ``swiftkv COMMAND [ARGS]`` (``toolkit.cli``; also ``python -m toolkit``): its help lists every
command of every room, each command's entry point resolves and answers ``--help`` under its front-door name, an
unknown command is one line, ``python -m distill`` (what ``accelerate launch -m distill`` runs) reaches the same
commands, and the front door starts without importing torch."""

from __future__ import annotations

import importlib
import runpy
import subprocess
import sys

import pytest
from helpers import ROOT

from toolkit.cli import COMMANDS, SECTIONS, main


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  ") and line.split()]
    assert [c.name for c in COMMANDS.values()] == [
        n for n in listed if n in COMMANDS
    ]  # in the sections' order
    assert set(COMMANDS) <= set(listed)
    assert [c.name for _, commands in SECTIONS for c in commands] == list(COMMANDS)  # no name twice
    assert main([]) == 0 and capsys.readouterr().out == out


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_resolves_and_answers_help(name, capsys):
    command = COMMANDS[name]
    module, _, function = command.entry.partition(":")
    assert callable(getattr(importlib.import_module(module), function)), command.entry
    assert main([name, "--help"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"usage: swiftkv {name} ") and err == "", out[:200]


def test_unknown_command_is_one_line_with_status_2(capsys):
    assert main(["no-such-command", "--help"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert (
        err.startswith("error: unknown command 'no-such-command' (to resolve, ") and "swiftkv --help" in err
    )


@pytest.mark.parametrize("name", ["quality", "info", "fetch", "suffix build"])
def test_an_unknown_argument_points_at_its_own_commands_help(name, capsys):
    positional = {"fetch": ["all"], "suffix build": [str(ROOT), "--out", str(ROOT / "x")]}.get(
        name, [str(ROOT)]
    )
    assert main([*name.split(), *positional, "--no-such-flag"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "unrecognized arguments: --no-such-flag" in err and f"see `swiftkv {name} --help`" in err, err


def test_python_m_distill_reaches_the_same_commands(monkeypatch, capsys):
    assert main(["check", "--help"]) == 0
    front_door = capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["distill", "check", "--help"])  # as `python -m distill check --help`
    monkeypatch.delitem(sys.modules, "distill.__main__", raising=False)  # run afresh, as a new process would
    with pytest.raises(SystemExit) as status:
        runpy.run_module("distill", run_name="__main__", alter_sys=True)
    assert status.value.code == 0
    assert capsys.readouterr().out == front_door


def test_the_front_door_starts_without_torch():
    """``import toolkit.cli``, ``swiftkv --help`` and the evaluation commands' ``--help`` in a fresh interpreter
    leave torch unimported."""
    code = (
        "import sys, contextlib, io\n"
        "import toolkit.cli\n"
        "assert 'torch' not in sys.modules, 'import toolkit.cli loaded torch'\n"
        "for argv in (['--help'], ['run', '--help'], ['quality', '--help'], ['harness', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        assert toolkit.cli.main(argv) == 0\n"
        "    assert 'torch' not in sys.modules, f'swiftkv {\" \".join(argv)} loaded torch'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
