"""Unexpected exceptions (bugs in qual): one line on stderr, exit 4, the traceback kept in a file."""

from __future__ import annotations

import os
import tempfile
import traceback
from contextlib import contextmanager
from pathlib import Path

from qual.errors import EngineError, InternalError, QualError
from qual.proc import outer_tmpdir

CRASH_FILE = "crash.txt"
_MESSAGE_CHARS = 200


def save_traceback(exc: BaseException, run_dir: Path | None) -> Path | None:
    """Write exc's traceback to <run_dir>/crash.txt, else to a new temporary file; None if neither can be written."""
    text = "".join(traceback.format_exception(exc))
    if run_dir is not None:
        try:
            path = Path(run_dir) / CRASH_FILE
            path.write_text(text)
            return path
        except OSError:
            pass  # a full or read-only disk: the temporary directory may still take it
    try:
        fd, name = tempfile.mkstemp(prefix="qual-crash-", suffix=".txt", dir=outer_tmpdir())  # not the private one
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return Path(name)
    except OSError:
        return None


def internal_error_line(exc: BaseException, saved: Path | None) -> str:
    """`internal error: <Type>: <first line of the message>; traceback in <path>` (one line, bounded)."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if len(message) > _MESSAGE_CHARS:
        message = message[:_MESSAGE_CHARS] + "..."
    where = f"traceback in {saved}" if saved else "the traceback could not be saved"
    return f"internal error (a bug in qual): {type(exc).__name__}{': ' + message if message else ''}; {where}"


@contextmanager
def crash_report(run_dir: Path):
    """Turn an unexpected exception inside a run into InternalError, its traceback saved in the run directory."""
    try:
        yield
    except (QualError, EngineError, InternalError):
        raise
    except Exception as exc:
        raise InternalError(internal_error_line(exc, save_traceback(exc, run_dir))) from exc
