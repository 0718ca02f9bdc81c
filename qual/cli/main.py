"""Top-level `qual` command: sub-apps are registered here, errors become exit codes."""

from __future__ import annotations

import sys

import typer

from qual.errors import EngineError, QualError

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

EXIT_GATE_FAILED = 1
EXIT_USAGE = 2
EXIT_ENGINE = 3


# Subcommand modules; importing one registers its commands on `app`.
SUBCOMMAND_MODULES: list[str] = ["run", "compare", "generate", "corpus", "toy", "history", "doctor"]


def _register() -> None:
    import importlib

    for name in SUBCOMMAND_MODULES:
        importlib.import_module(f"qual.cli.{name}")


def _terminate(signum, frame):
    # SIGTERM (CI timeouts, kill) unwinds like Ctrl-C, so servers and rank processes are stopped.
    raise KeyboardInterrupt


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
    import signal

    signal.signal(signal.SIGTERM, _terminate)
    _register()
    try:
        # Without standalone mode click returns typer.Exit's code instead of raising it.
        code = app(standalone_mode=False)
    except QualError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    except EngineError as exc:
        print(f"engine failure: {exc}", file=sys.stderr)
        sys.exit(EXIT_ENGINE)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # click usage errors arrive as ClickException
        aborts, usage_errors = _click_exceptions()
        if isinstance(exc, aborts):
            sys.exit(130)
        if isinstance(exc, usage_errors):
            print(f"error: {exc.format_message()}", file=sys.stderr)
            sys.exit(EXIT_USAGE)
        raise
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":  # `python -m qual.cli.main`: run the importable module's app, where commands registered
    from qual.cli.main import main as _main

    _main()
