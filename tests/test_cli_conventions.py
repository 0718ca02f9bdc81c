"""CLI conventions: `qual --version`, `-h` wherever `--help` works, one default history database for run and history."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import qual
from checkpoints import make_profile

QUAL = [sys.executable, "-m", "qual"]


def run(*args, cwd=None):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(qual.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([*QUAL, *map(str, args)], capture_output=True, text=True, timeout=300, cwd=cwd, env=env)


def test_version():
    proc = run("--version")
    assert proc.returncode == 0 and proc.stdout.startswith(f"qual {qual.__version__}")


def _commands(group, path=()):
    """Every command and group of the CLI, as argv prefixes."""
    yield list(path)
    if hasattr(group, "commands"):  # a group (of click, or of the click copy newer typers carry)
        for name, sub in group.commands.items():
            yield from _commands(sub, (*path, name))


def test_h_is_help_everywhere():
    import typer.main
    from typer.testing import CliRunner

    from qual.cli.main import _register, app

    _register()
    root = typer.main.get_command(app)
    commands = list(_commands(root))
    assert len(commands) > 10 and ["history", "list"] in commands and ["run"] in commands
    runner = CliRunner()
    for command in commands:
        short, long = runner.invoke(app, [*command, "-h"]), runner.invoke(app, [*command, "--help"])
        assert short.exit_code == long.exit_code == 0, (command, short.output)
        assert short.output == long.output and "Usage:" in short.output, command


def test_run_and_history_share_the_default_history(tmp_path):
    profile = make_profile(tmp_path / "prof")
    work = tmp_path / "work"
    work.mkdir()
    done = run("run", "--model", profile, "--dcp", 1, "--tp", 1, "--limit", 1, "--max-tokens", 2, cwd=work)
    assert done.returncode == 0, done.stderr
    listed = run("history", "list", cwd=work)
    assert listed.returncode == 0 and "tiny" in listed.stdout and "no runs recorded" not in listed.stdout, listed.stdout
    assert (work / "reports" / "history.sqlite").is_file()
