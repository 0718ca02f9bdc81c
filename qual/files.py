"""Writing qual's output files: whole or not at all, and a failed write is one line (exit 2), never a traceback.

A full disk or a read-only folder is the user's to fix (free space, then `qual run --resume`), like an
unwritable --out; nothing half-written keeps a final name and no temporary file is left behind.
"""

from __future__ import annotations

import errno
import fcntl
import os
import tempfile
from pathlib import Path

from qual.errors import QualError


class WriteError(QualError):
    """An output file could not be written (disk full, read-only, permissions): exit 2."""

    def __init__(self, path: Path, exc: OSError):
        self.path, self.errno = Path(path), exc.errno
        super().__init__(f"cannot write {path}: {exc.strerror or exc}")

    @property
    def remedy(self) -> str:
        """What the user does before trying again, by the cause."""
        if self.errno in (errno.ENOSPC, errno.EDQUOT):
            return "free space"
        if self.errno == errno.EROFS:
            return "make its file system writable"
        if self.errno in (errno.EACCES, errno.EPERM):
            return "make it writable"
        return "fix the cause"


def write_text(path: str | Path, text: str) -> Path:
    """Write path atomically as UTF-8 text (write_bytes)."""
    return write_bytes(path, text.encode("utf-8"))


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Write path atomically: a temporary file beside it, fsync'd, then renamed over it.

    The temporary file is created new (O_EXCL, a random name): a file or a link already there under any name is
    never written through, and the rename replaces a link at `path` itself, never what it points to."""
    path = Path(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would make reports unreadable to others
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None:
            try:
                os.unlink(tmp)  # unlinking frees space, so it works on a full disk too
            except OSError:
                pass
        raise WriteError(path, exc) from None
    return path


class AppendOnly:
    """A file of whole lines: each append is written and fsync'd, or (when the write fails) undone."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            # O_NOFOLLOW: a journal that is a link (to a file elsewhere) is refused, never appended through
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
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


class DirectoryLock:
    """An exclusive lock on a run directory for this process's life: two qual processes never write one run
    directory at once. It is flock on the directory itself, so nothing is added to it, and the kernel drops the
    lock when the process ends, however it ends."""

    def __init__(self, directory: str | Path, what: str):
        try:
            self._fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise WriteError(Path(directory), exc) from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _flock_holder(os.fstat(self._fd))
            os.close(self._fd)
            raise QualError(f"{what} {directory} is in use by another qual process (pid {holder}); wait for it to "
                            f"end, or stop it") from None

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _flock_holder(st: os.stat_result) -> str:
    """The pid holding a flock on the file `st` describes, from /proc/locks ("unknown" where it cannot be read)."""
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return "unknown"
    for line in lines:  # "1: FLOCK  ADVISORY  WRITE 4242 00:2e:1311 0 EOF"
        fields = line.split()
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == inode:
            return fields[4]
    return "unknown"
