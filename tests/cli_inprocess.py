"""`qual ARGS` in the test's own process: run_app gives the exit codes and one-line errors that `python -m qual` gives
(qual/cli/main.py), without a subprocess's ~1-3 s of imports. For commands that start no engine (refusals, dry runs,
reports); what only a separate process can show (signals, locks held by another pid, the console script) stays a
subprocess."""

from types import SimpleNamespace

from qual.cli.main import _register, run_app

_register()  # every subcommand on the app that run_app runs


def qual_in(capsys, *args) -> SimpleNamespace:
    """returncode, stdout and stderr of `qual ARGS`, like subprocess.run's."""
    capsys.readouterr()
    code = run_app(list(map(str, args)))
    out = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)
