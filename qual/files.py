"""Writing qual's output files: whole or not at all, and a failed write is one line (exit 2), never a traceback.

A full disk or a read-only folder is the user's to fix (free space, then `qual run --resume`), like an
unwritable --out; nothing half-written keeps a final name and no temporary file is left behind.
"""

from __future__ import annotations

import os
from pathlib import Path

from qual.errors import QualError


class WriteError(QualError):
    """An output file could not be written (disk full, read-only, permissions): exit 2."""

    def __init__(self, path: Path, exc: OSError):
        self.path, self.errno = Path(path), exc.errno
        super().__init__(f"cannot write {path}: {exc.strerror or exc}")


def write_text(path: str | Path, text: str) -> Path:
    """Write path atomically: a temporary file beside it, fsync'd, then renamed over it."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        try:
            tmp.unlink(missing_ok=True)  # unlinking frees space, so it works on a full disk too
        except OSError:
            pass
        raise WriteError(path, exc) from None
    return path


class AppendOnly:
    """A file of whole lines: each append is written and fsync'd, or (when the write fails) undone."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as exc:
            raise WriteError(self.path, exc) from None

    def append(self, line: str) -> None:
        data = line.encode("utf-8")
        start = os.fstat(self._fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
            os.fsync(self._fd)
        except OSError as exc:
            try:  # no torn line stays behind: the file is exactly its whole lines
                os.ftruncate(self._fd, start)
            except OSError:
                pass  # a torn last line is still dropped when the file is read (journal.read_journal)
            raise WriteError(self.path, exc) from None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
