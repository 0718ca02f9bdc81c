"""CLI conventions: `qual --version`, `-h` wherever `--help` works, one default history database for run and history."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

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


def test_no_flag_shows_a_value_placeholder_in_help():
    """A flag takes no value: no command's help shows `<bool>` after one (typer's rich panel did, `--dry-run <bool>`),
    while options that take a value keep their type."""
    import typer.main
    from typer.testing import CliRunner

    from qual.cli.main import _register, app

    _register()
    runner = CliRunner()
    helps = {" ".join(c) or "qual": runner.invoke(app, [*c, "--help"], terminal_width=200).output
             for c in _commands(typer.main.get_command(app))}
    assert [name for name, text in helps.items() if "<bool>" in text.lower()] == []
    assert re.search(r"--dry-run\s+Print both arms", helps["run"]) and re.search(r"--limit\s+N ", helps["run"])
    assert re.search(r"--help\s+-h\s+Show this message", helps["doctor"])


def test_run_and_history_share_the_default_history(tmp_path, monkeypatch):
    """Where `qual run` records a run by default is where `qual history` reads by default (one path, paths.py)."""
    from typer.testing import CliRunner

    from qual.cli.main import _register, app
    from qual.harness.plan import RunOptions, make_plan
    from qual.history import record_run
    from qual.paths import DEFAULT_HISTORY
    from synthetic import synthetic_result

    profile = make_profile(tmp_path / "prof")
    monkeypatch.chdir(tmp_path)
    plan = make_plan(RunOptions(model=str(profile), dcp=1, tp=1, limit=1), dry_run=True)
    assert plan.history_path == DEFAULT_HISTORY and not plan.history_path.is_absolute()
    plan.history_path.parent.mkdir(parents=True)
    record_run(plan.history_path, synthetic_result(4), "reports/x/result.json")  # what execute() does at the end
    _register()
    listed = CliRunner().invoke(app, ["history", "list"])
    assert listed.exit_code == 0, listed.output
    assert "no runs recorded" not in listed.output and " toy " in listed.output, listed.output
