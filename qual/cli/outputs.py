"""Where a command will write, checked before it does any work: a bad --out or --history is exit 2, not a
traceback after both arms have run."""

from __future__ import annotations

import os
from pathlib import Path

from qual.errors import QualError
from qual.userfiles import check_path_name

RUN_FILES = ("run.json", "control.requests.jsonl", "candidate.requests.jsonl")  # what `qual run` leaves in its --out


def output_dir(path: Path, option: str) -> None:
    """Create the directory (as the run would), or say in one line why it cannot be or cannot be written."""
    check_path_name(path, option)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise QualError(f"{option} {path}: cannot create this directory ({exc.strerror or exc})") from None
    # An existing directory is created without a write: its file system may still be read-only, or the folder
    # not ours. Said now, with its cause, not as a failed write (and "free space") after both arms ran.
    if not os.access(path, os.W_OK | os.X_OK):
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
        cause = "its file system is mounted read-only" if read_only else "permission denied"
        raise QualError(f"{option} {path}: cannot write in this directory ({cause})")


def claim_fresh_dir(base: Path, option: str) -> Path:
    """base, or base-2, base-3, ... if it exists: the first that this process creates itself (mkdir is atomic, so two
    runs started in the same second with the default --out each get their own)."""
    output_dir(base.parent, option)
    for n in range(1, 1000):
        path = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        except OSError as exc:
            raise QualError(f"{option} {path}: cannot create this directory ({exc.strerror or exc})") from None
        return path
    raise QualError(f"{option} {base}: it and {base.name}-2 .. -999 exist already")


def holds_run(path: Path) -> str | None:
    """The file that makes `path` a run's directory (`qual run`'s run.json or a journal), or None."""
    return next((name for name in RUN_FILES if (path / name).exists()), None)


def history_file(path: Path, option: str = "--history") -> None:
    """The history database's folder exists or can be made, and the path is not a folder itself."""
    check_path_name(path, option)
    if path.is_dir():
        raise QualError(f"{option} {path}: is a directory; give the database file's path")
    output_dir(path.parent, option)
