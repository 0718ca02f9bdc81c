"""Top-level `qual` command: sub-apps are registered here, errors and signals become exit codes."""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading

import typer
import typer.core

from qual import stop_signals
from qual.cli import streams
from qual.cli.crash import internal_error_line, save_traceback
from qual.cli.streams import say
from qual.errors import EngineError, InternalError, QualError
from qual.proc import private_tmp, signals_held
from qual.shown import safe
from qual.stop_signals import STOP_SIGNALS


# Help's value placeholders in plain words, as click writes them: the rich panel of typer 0.2x (which carries its own
# click) prints `<str>`, `<int range>`, `<path>`; these are its words for the same types.
_PLAIN_TYPES = {"str": "TEXT", "int": "INTEGER", "int range": "INTEGER", "float": "FLOAT", "float range": "FLOAT",
                "path": "PATH", "file": "FILE", "directory": "DIR", "list[str]": "TEXT", "list[Path]": "PATH"}


def _plain(shown: str | None) -> str | None:
    """'<int range>' -> 'INTEGER'; '<a|b>' (choices) -> 'a|b'; a metavar as it is."""
    if shown is None or not (shown.startswith("<") and shown.endswith(">")):
        return shown
    inner = shown[1:-1]
    return _PLAIN_TYPES.get(inner, inner)


def _plain_help() -> None:
    """Help as people read it, where typer's rich help (from 0.2x) says otherwise:
    - no value placeholder after a flag (`--dry-run`, `--help`): typer prints every option's type, flags included, as
      if `--dry-run <bool>` took a value; click's plain help prints none;
    - a value's placeholder in click's words (TEXT, INTEGER, PATH) or the option's metavar, never `<str>`;
    - a required argument as its name in capitals (`qual history publish [OPTIONS] DIR`), never `{DIR}` or `{a}`.
    An older typer (click's own help) already does all three: nothing is changed there."""
    option, argument = getattr(typer.core, "TyperOption", None), getattr(typer.core, "TyperArgument", None)
    shown = getattr(option, "display_type_rich", None)
    if shown is None or getattr(shown, "plain", False) or argument is None:
        return

    def option_type(self, ctx):
        return None if self.is_flag and not self.count else _plain(shown(self, ctx))

    argument_shown = argument.display_type_rich

    def argument_type(self, ctx):
        return None if self.metavar is not None else _plain(argument_shown(self, ctx))

    def usage_name(self) -> str:
        name = self.display_name_raw if self.required else f"[{self.display_name_raw}]"
        return name + ("..." if self.nargs != 1 else "")

    option_type.plain = True
    option.display_type_rich = option_type
    argument.display_type_rich = argument_type
    argument.display_name_raw = property(lambda self: self.metavar if self.metavar is not None else self.name.upper())
    argument._usage_display_name = usage_name


_plain_help()

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="Acceptance-rate qualification of DFlash speculative decoding under decode context parallelism.",
    context_settings={"help_option_names": ["-h", "--help"]},  # inherited by every subcommand and group
)


def _print_version(value: bool) -> None:
    if value:
        from qual import __version__
        from qual.provenance import qual_commit

        commit, dirty = qual_commit()
        where = f" (git {commit[:12]}{', modified' if dirty else ''})" if commit else ""
        print(f"qual {__version__}{where}")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                       help="Print qual's version (and git commit, from a checkout) and exit.")) -> None:
    """Acceptance-rate qualification of DFlash speculative decoding under decode context parallelism."""


# The exit-code contract: only a gate verdict exits 1.
EXIT_GATE_FAILED = 1
EXIT_USAGE = 2
EXIT_ENGINE = 3
EXIT_INTERNAL = 4
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # stdout closed by its reader, as a shell reports a process that SIGPIPE ended
# After the first SIGTERM or SIGINT the command unwinds (rank processes killed, servers stopped, journals
# closed). If that has not ended the process this many seconds later (a call blocked in C++ on a peer), the
# process ends anyway: journals are fsync'd line by line and every child dies with its parent (see
# qual/proc.py), so nothing is lost that a --resume needs.
INTERRUPT_DEADLINE_S = 8.0


# Subcommand modules; importing one registers its commands on `app`.
SUBCOMMAND_MODULES: list[str] = ["run", "compare", "generate", "corpus", "toy", "history", "doctor", "schema"]


def _register() -> None:
    import importlib

    for name in SUBCOMMAND_MODULES:
        importlib.import_module(f"qual.cli.{name}")


class Interrupts:
    """SIGTERM and SIGINT handler: the first unwinds like Ctrl-C, under a deadline; a second ends the process now."""

    def __init__(self, deadline_s: float = INTERRUPT_DEADLINE_S):
        self.deadline_s = deadline_s
        self.first: int | None = None
        self.before_exit = lambda: None  # what a hard exit still does (the private temporary folder goes)
        self.finished: int | None = None  # the command's exit code once it returned: a signal then exits with it

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self)

    def __call__(self, signum, frame):
        if self.first is not None:
            self._exit(f"{signal.Signals(signum).name} again")
        if self.finished is not None:  # nothing left to unwind, and the outcome (a gate's exit 1) stands
            self.before_exit()
            os._exit(self.finished)
        self.first = stop_signals.received = signum
        timer = threading.Timer(self.deadline_s, self._exit, (f"not stopped {self.deadline_s:.0f} s after {signal.Signals(signum).name}",))
        timer.daemon = True
        timer.start()
        raise KeyboardInterrupt

    def _exit(self, why: str) -> None:
        try:
            sys.stderr.write(f"interrupted ({why}): exiting now\n")
            sys.stderr.flush()
            self.before_exit()
        finally:
            os._exit(EXIT_INTERRUPTED)


def _click_exceptions() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """(Abort, ClickException) classes: click's, and those of the copy of click that newer typer versions carry
    (typer 0.29 raises its own, which click's classes do not match)."""
    aborts, errors = [typer.Abort], [c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException"]
    try:
        import click

        aborts.append(click.exceptions.Abort)
        errors.append(click.ClickException)
    except ImportError:
        pass
    return tuple(aborts), tuple(errors)


def main() -> None:
    """Console-script entry point: one-line errors, stable exit codes."""
    streams.prepare()  # before anything opens a file that could take a closed stdout's descriptor
    _register()  # still under qual.cli.entry's start-up handler: nothing has been created that an exit must undo
    interrupts = Interrupts()
    try:
        with signals_held(set(STOP_SIGNALS)):  # the private folder exists only with the handler that removes it
            tmp = private_tmp()
            interrupts.before_exit = tmp.remove
            interrupts.install()
        code = run_app()  # a signal held above arrives here at the latest, inside run_app or just before it
    except KeyboardInterrupt:
        say("interrupted")
        code = EXIT_INTERRUPTED
    interrupts.finished = code
    if code == EXIT_INTERRUPTED:
        # Everything a --resume needs is on disk and every child is gone: skip the interpreter's teardown,
        # which takes seconds once torch is loaded, so that a CI job's SIGTERM ends the process at once.
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, QualError):  # output that cannot be written changes nothing now
                pass
        tmp.remove()
        os._exit(code)
    sys.exit(code)


def _working_directory_gone() -> bool:
    """Whether the working directory was deleted while the shell stayed in it: no relative path can be found or
    written, and torch's MKL cannot load (it exits the process with a message of its own)."""
    try:
        os.getcwd()
    except FileNotFoundError:
        return True
    return False


def run_app(args: list[str] | None = None) -> int:
    """Run the CLI; every outcome becomes one exit code of the contract (and at most one line on stderr)."""
    if _working_directory_gone():  # checked before any work: nothing is read, started or written
        say("error: the working directory no longer exists (deleted after the shell entered it): cd to an existing "
            "folder and run the command again")
        return EXIT_USAGE
    try:
        # Without standalone mode click returns typer.Exit's code instead of raising it (and typer turns a
        # KeyboardInterrupt into Exit(130)).
        code = app(args=args, standalone_mode=False)
    # Messages quote file names, file contents and server replies: escaped, each stays one line a terminal only shows
    except QualError as exc:
        say(f"error: {safe(exc)}")
        return EXIT_USAGE
    except EngineError as exc:
        say(f"engine failure: {safe(exc)}")
        return EXIT_ENGINE
    except InternalError as exc:
        say(safe(exc))
        return EXIT_INTERNAL
    except typer.Exit as exc:
        code = exc.exit_code
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    except SystemExit as exc:
        if _broken_pipe(exc):  # typer answers EPIPE with exit 1, which means "gate failed" here
            return EXIT_BROKEN_PIPE
        raise
    except Exception as exc:  # click usage errors arrive as ClickException
        aborts, usage_errors = _click_exceptions()
        if isinstance(exc, aborts):
            code = EXIT_INTERRUPTED
        elif isinstance(exc, usage_errors):
            say(f"error: {safe(exc.format_message())}")
            return EXIT_USAGE
        else:
            # Anything else is a bug in qual, never "gate failed": exit 4, the traceback kept in a file.
            say(safe(internal_error_line(exc, save_traceback(exc, None))))
            return EXIT_INTERNAL
    code = code if isinstance(code, int) else 0
    if code == EXIT_INTERRUPTED:
        say("interrupted")
    return _flushed(code)


def _flushed(code: int) -> int:
    """code, once stdout's buffered output is written: here a full disk is one line and exit 2 and a reader gone is
    141, where at exit nothing could say so and the command's code would stand."""
    try:
        sys.stdout.flush()
    except OSError as exc:
        if exc.errno != errno.EPIPE:
            raise
        return EXIT_BROKEN_PIPE
    except QualError as exc:  # streams.StdoutError
        say(f"error: {safe(exc)}")
        return EXIT_USAGE
    return code


def _broken_pipe(exc: SystemExit) -> bool:
    cause = exc.__context__
    return isinstance(cause, OSError) and cause.errno == errno.EPIPE


if __name__ == "__main__":  # `python -m qual.cli.main`: run the importable module's app, where commands registered
    from qual.cli.main import main as _main

    _main()
