"""Where a command will write, checked before it does any work: a bad --out or --history is exit 2, not a
traceback after both arms have run."""

from __future__ import annotations

from pathlib import Path

from qual.errors import QualError


def output_dir(path: Path, option: str) -> None:
    """Create the directory (as the run would) or say in one line why it cannot be."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise QualError(f"{option} {path}: cannot create this directory ({exc.strerror or exc})") from None


def history_file(path: Path, option: str = "--history") -> None:
    """The history database's folder exists or can be made, and the path is not a folder itself."""
    if path.is_dir():
        raise QualError(f"{option} {path}: is a directory; give the database file's path")
    output_dir(path.parent, option)
