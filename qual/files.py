"""Writing qual's output files: whole or not at all, and a failed write is one line (exit 2), never a traceback.

Every file qual writes goes through here (tests/test_io_boundary.py refuses a raw write elsewhere): reports,
result.json, run.json, arm records, journals, figures, caches, the published site, a crash's traceback. A file is
written to a new temporary file in its own folder (O_EXCL, a random name: a file or a link already there under any
name is never written through), fsync'd and renamed over the target (a link at the target itself is replaced,
never followed); an append-only journal is opened without following a link. A full disk or a read-only folder is
the user's to fix (free space, then `qual run --resume`), like an unwritable --out; nothing half-written keeps a
final name and no temporary file is left behind (one a kill -9 left is recognised: `is_leftover`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

from qual.errors import QualError
from qual.userfiles import open_regular, read_text

# The temporary names write_* use: ".<name>.<random>.tmp" (mkstemp's random part is 8 characters)
_LEFTOVER = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$")


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


def write_with(path: str | Path, write: Callable[[BinaryIO], None]) -> Path:
    """Write path atomically with write(file): a temporary file beside it, fsync'd, then renamed over it (a figure's
    savefig, an array's save: anything that writes to a file object)."""
    path = Path(path)
    check_replaceable(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name[:200]}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            write(f)
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


def check_replaceable(path: Path) -> None:
    """What is at path may be replaced: nothing, a regular file, or a link (replaced itself, never followed). A
    FIFO, a device or a folder there is refused: renaming over it would remove it from the file system."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise WriteError(path, exc) from None
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else \
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket"
        raise QualError(f"{path}: is {kind}; qual writes a file only where a regular file (or nothing) is")


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Write path atomically (write_with)."""
    return write_with(path, lambda f: f.write(data))


def write_text(path: str | Path, text: str) -> Path:
    """Write path atomically as UTF-8 (write_with)."""
    return write_bytes(path, text.encode("utf-8"))


def save_numpy(path: str | Path, array) -> Path:
    """A numpy array as .npy, written atomically."""
    import numpy as np

    return write_with(path, lambda f: np.save(f, array, allow_pickle=False))


def save_torch(path: str | Path, obj) -> Path:
    """torch.save of tensors and plain containers, written atomically."""
    import torch

    return write_with(path, lambda f: torch.save(obj, f))


def save_safetensors(path: str | Path, tensors: dict) -> Path:
    """Tensors as one safetensors file (metadata format: pt, what transformers' from_pretrained expects), written
    atomically; each tensor detached and made contiguous on the CPU first, as the format stores it."""
    from safetensors.torch import save

    data = save({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, metadata={"format": "pt"})
    return write_bytes(path, data)


def write_new(directory: str | Path, prefix: str, suffix: str, text: str) -> Path:
    """A new file under a random name in directory (O_EXCL: nothing there is written through), written whole."""
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        os.unlink(name)
        raise WriteError(Path(name), exc) from None
    return Path(name)


def is_leftover(name: str) -> bool:
    """Whether a file name is one of write_*'s temporary names: what a process killed while writing left behind."""
    return _LEFTOVER.match(name) is not None


def copy_file(source: str | Path, target: str | Path, limit: int, what: str = "file") -> None:
    """Copy a regular file of at most `limit` bytes to a new file `target` (never one already there, never through
    a link). QualError where the source is refused (not a regular file, larger than limit), OSError where it cannot
    be opened, WriteError where the target cannot be written."""
    fd = open_regular(source, what)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise QualError(f"{source}: larger than a {what} may be ({limit} bytes); not copied")
        try:
            out = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise WriteError(Path(target), exc) from None
        try:
            copied = 0
            while copied < limit + 1 and (chunk := os.read(fd, min(1 << 20, limit + 1 - copied))):
                copied += len(chunk)
                view = memoryview(chunk)
                while view:
                    view = view[os.write(out, view):]
            if copied > limit:  # it grew while it was copied
                raise QualError(f"{source}: larger than a {what} may be ({limit} bytes); not copied")
        except OSError as exc:
            raise WriteError(Path(target), exc) from None
        finally:
            os.close(out)
    finally:
        os.close(fd)


def remove_tree(path: str | Path) -> None:
    """Remove a folder qual made (a temporary one, a site replaced) and everything in it; links inside are removed,
    never followed. What cannot be removed stays."""
    shutil.rmtree(path, ignore_errors=True)


def open_append(path: str | Path, binary: bool = False):
    """A log file opened for appending (created where missing), never through a link, and a regular file: what a
    server's output or an attach log goes to. The caller closes it."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     0o644)
    except OSError as exc:
        raise WriteError(path, exc) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise QualError(f"{path}: is not a regular file; a log is not written there")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "ab" if binary else "a", **({} if binary else {"encoding": "utf-8"}))


class AppendOnly:
    """A file of whole lines: each append is written and fsync'd, or (when the write fails) undone. A torn last line
    (a process killed mid-write) is cut off when the file is opened, through the same descriptor."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            # O_NOFOLLOW: a journal that is a link (to a file elsewhere) is refused, never appended through or cut;
            # O_NONBLOCK: a FIFO in its place is refused below, not waited on
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK
                               | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise WriteError(self.path, exc) from None
        try:
            if not stat.S_ISREG(os.fstat(self._fd).st_mode):
                raise QualError(f"{self.path}: is not a regular file; a journal is not written there")
            os.set_blocking(self._fd, True)
            self._drop_torn_line()
        except BaseException:
            self.close()
            raise

    def _drop_torn_line(self) -> None:
        size = end = os.fstat(self._fd).st_size
        while end > 0:  # back to the last newline, a chunk at a time
            start = max(0, end - (1 << 16))
            chunk = os.pread(self._fd, end - start, start)
            if end == size and chunk.endswith(b"\n"):
                return
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                end = start + cut + 1
                break
            end = start
        try:
            os.ftruncate(self._fd, end)
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
        self._fd = -1
        try:
            self._fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise WriteError(Path(directory), exc) from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _flock_holder(os.fstat(self._fd))
            self.release()
            raise QualError(f"{what} {directory} is in use by another qual process (pid {holder}); wait for it to "
                            f"end, or stop it") from None

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def holds(self, directory: str | Path) -> bool:
        """Whether directory is still the folder this lock holds (not removed, replaced or a link since it was
        opened)."""
        try:
            there, held = os.lstat(directory), os.fstat(self._fd)
        except OSError:
            return False
        return stat.S_ISDIR(there.st_mode) and (there.st_dev, there.st_ino) == (held.st_dev, held.st_ino)

    def __del__(self) -> None:  # a lock an error dropped before its release (a refused --resume) ends with it
        self.release()


def locked_folder(parent: str | Path, prefix: str, what: str) -> tuple[Path, DirectoryLock]:
    """A new folder in parent named prefix and 8 random characters (mkdtemp), held by a DirectoryLock from its first
    moment to the lock's release or this process's end: what `abandoned_folders` passes over."""
    for _ in range(3):
        try:
            path = Path(tempfile.mkdtemp(dir=parent, prefix=prefix))
        except OSError as exc:
            raise WriteError(Path(parent), exc) from None
        try:
            lock = DirectoryLock(path, what)
        except QualError:  # another process's abandoned_folders took it for one a killed process left: a new one
            continue
        if lock.holds(path):
            return path, lock
        lock.release()
    raise QualError(f"{what}: cannot keep a new folder in {parent}: another process removes each one made there")


def abandoned_folders(parent: str | Path, prefix: str, what: str) -> list[tuple[Path, DirectoryLock]]:
    """The folders in parent named prefix and 8 random characters (locked_folder's) that no process holds: their
    makers ended before removing them (a kill -9). Each is returned locked for the caller, who removes it and
    releases the lock; a link or a file of such a name is passed over."""
    pattern = re.compile(re.escape(prefix) + r"[a-z0-9_]{8}")
    try:
        names = sorted(e.name for e in os.scandir(parent) if pattern.fullmatch(e.name))
    except OSError:
        return []
    found = []
    for name in names:
        path = Path(parent) / name
        if path.is_symlink() or not path.is_dir():
            continue
        try:
            lock = DirectoryLock(path, what)
        except QualError:  # its maker still runs (or it is gone already)
            continue
        if lock.holds(path):
            found.append((path, lock))
        else:
            lock.release()
    return found


def _flock_holder(st: os.stat_result) -> str:
    """The pid holding a flock on the file `st` describes, from /proc/locks ("unknown" where it cannot be read)."""
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        lines = read_text("/proc/locks", 1 << 24, "lock table").splitlines()
    except (OSError, QualError):
        return "unknown"
    for line in lines:  # "1: FLOCK  ADVISORY  WRITE 4242 00:2e:1311 0 EOF"
        fields = line.split()
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == inode:
            return fields[4]
    return "unknown"
