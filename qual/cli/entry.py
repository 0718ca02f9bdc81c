"""The `qual` command's first code: interrupts are answered from its first instruction on.

Importing the CLI (typer, rich, qual's modules) takes a moment; a SIGINT, SIGTERM or SIGHUP meanwhile would end
the process with Python's default (a traceback, or death by the signal) instead of the contract's exit 130. Until
the CLI installs its own handlers (qual.cli.main.Interrupts) nothing has started, so there is nothing to stop.
"""

import os
import signal

from qual.stop_signals import STOP_SIGNALS  # imports only `signal`: the handlers are in place within milliseconds


def _interrupted_at_startup(signum, frame) -> None:
    os.write(2, f"interrupted ({signal.Signals(signum).name} during start-up)\n".encode())
    os._exit(130)


def main() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, _interrupted_at_startup)
    from qual.cli.main import main as cli

    try:
        cli()
        code = 0
    except SystemExit as done:
        code = 0 if done.code is None else done.code if isinstance(done.code, int) else 1
    _exit_skipping_teardown(code)


def _exit_skipping_teardown(code: int) -> None:
    """End the process with `code` after what exit must still do (flush output; the exit functions: the private
    temporary folder goes), without the interpreter's module teardown. That teardown takes seconds once torch is
    loaded, and it first resets the signal handlers: a Ctrl-C during it would turn a finished command into death by
    SIGINT."""
    import atexit
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - None (closed at start), a reader gone, a full disk: the code is decided
            pass
    atexit._run_exitfuncs()
    os._exit(code)
