"""Unexpected exceptions (bugs in qual): one line on stderr, exit 4, the traceback kept in a file. Inside a run's
output directory an engine failure (exit 3) or an internal error (exit 4) also leaves a junit.xml whose one test
case is in error, naming the cause: a CI job that publishes JUnit shows why the run has no verdict."""

from __future__ import annotations

import traceback
from contextlib import contextmanager
from pathlib import Path

from qual.errors import EngineError, InternalError, QualError
from qual.files import WriteError, write_new, write_text
from qual.cli.streams import StdoutClosed
from qual.proc import outer_tmpdir

CRASH_FILE = "crash.txt"
_MESSAGE_CHARS = 200


def save_traceback(exc: BaseException, run_dir: Path | None) -> Path | None:
    """Write exc's traceback to <run_dir>/crash.txt, else to a new temporary file; None if neither can be written."""
    text = "".join(traceback.format_exception(exc))
    if run_dir is not None:
        try:
            return write_text(Path(run_dir) / CRASH_FILE, text)
        except (OSError, WriteError):
            pass  # a full or read-only disk: the temporary directory may still take it
    try:
        return write_new(outer_tmpdir(), "qual-crash-", ".txt", text)  # not the private one
    except (OSError, WriteError):
        return None


def internal_error_line(exc: BaseException, saved: Path | None) -> str:
    """`internal error: <Type>: <first line of the message>; traceback in <path>` (one line, bounded)."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if len(message) > _MESSAGE_CHARS:
        message = message[:_MESSAGE_CHARS] + "..."
    where = f"traceback in {saved}" if saved else "the traceback could not be saved"
    return f"internal error (a bug in qual): {type(exc).__name__}{': ' + message if message else ''}; {where}"


def error_junit(run_dir: Path, suite: str, exc: EngineError | InternalError) -> Path | None:
    """<run_dir>/junit.xml with one test case in error: the line stderr shows for exc (secret shapes redacted).
    None if it cannot be written: the exit code and the line on stderr are what counts."""
    from qual.report import FILES, junit

    if isinstance(exc, EngineError):
        case, message = "engine_failure", f"engine failure: {exc}"
    else:
        case, message = "internal_error", str(exc)
    try:
        return junit.write_error(Path(run_dir) / FILES["junit"], suite, case, message, type(exc).__name__)
    except Exception:  # noqa: BLE001 - a full disk, or a bug here, must not replace the error being reported
        return None


@contextmanager
def crash_report(run_dir: Path, suite: str = "qual"):
    """Turn an unexpected exception inside a run into InternalError, its traceback saved in the run directory; an
    engine failure or internal error leaves junit.xml there naming it (test suite `suite`)."""
    try:
        yield
    except (QualError, StdoutClosed):  # a reader of stdout that went away is exit 141 (qual.cli.main), not a bug
        raise
    except (EngineError, InternalError) as exc:
        error_junit(run_dir, suite, exc)
        raise
    except Exception as exc:
        error = InternalError(internal_error_line(exc, save_traceback(exc, run_dir)))
        error_junit(run_dir, suite, error)
        raise error from exc
