"""Child processes that die with their parent, and what /proc says about processes and their listening sockets.

Linux facts: the kernel's parent-death signal (prctl PR_SET_PDEATHSIG) and the socket tables in /proc/net.
Elsewhere the functions degrade to "nothing known" (no /proc) or no-ops, and callers keep their other guards.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from qual.errors import QualError
from qual.files import remove_tree
from qual.paths import cache_dir
from qual.userfiles import read_text
from qual.validation import ascii_digits

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
MAX_PROC_BYTES = 1 << 16  # a process's stat line, a thread's children
MAX_SOCKET_TABLE_BYTES = 1 << 26  # /proc/net/tcp of a busy host: 150 bytes a socket
_TCP_LISTEN = "0A"  # st column of /proc/net/tcp{,6}


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL, *, via_server: bool = False) -> bool:
    """Ask the kernel to send sig to this process when its parent thread exits (True if it will).

    parent_pid is this process's parent or, with via_server, its grandparent: this process was forked by a
    server that parent_pid started and that itself dies with parent_pid (qual/runtime/rank_server.py). Either
    may have died before the request took effect: then this process is already an orphan and exits at once
    instead (its parent, or its parent's parent, no longer is parent_pid).
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):  # no prctl: not Linux
        armed = False
    parent = os.getppid()
    if via_server:
        parent = parent_of(parent)
    if parent is not None and parent != parent_pid:
        os._exit(1)
    return armed


@contextmanager
def signals_held(signals: set) -> Iterator[None]:
    """Hold these signals (blocked, not ignored) inside: one that arrives stays pending and reaches this thread's
    handler as the block ends, at the first instruction after it.

    For code that a handler which raises must not interrupt: importing torch calls back into Python from C++
    through pybind11, and a KeyboardInterrupt raised there ends in std::terminate (the process aborts, exit -6)
    instead of unwinding. Only the main thread receives Python's signal handlers; elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def parent_of(pid: int) -> int | None:
    """pid's parent, from /proc (None if pid is gone or there is no /proc: nothing known)."""
    fields = _stat_fields(pid)
    return int(fields[1]) if fields and len(fields) >= 2 else None


def _stat_fields(pid: int | str) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name: state ppid pgrp ... (None if gone)."""
    try:
        stat = read_text(f"/proc/{pid}/stat", MAX_PROC_BYTES, "process status")
    except (OSError, QualError):
        return None
    return stat[stat.rfind(")") + 2 :].split()


def _pids() -> list[int]:
    try:
        return [int(e.name) for e in os.scandir("/proc") if ascii_digits(e.name)]
    except OSError:
        return []


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group pgid, from /proc."""
    members = []
    for pid in _pids():
        fields = _stat_fields(pid)
        if fields and len(fields) >= 3 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(pid)
    return members


def descendants(pid: int) -> list[int]:
    """Live processes below pid (children, their children, ...), from /proc."""
    if _CHILDREN_LISTED:
        found, todo = [], [pid]
        while todo:
            for c in _children(todo.pop()):
                fields = _stat_fields(c)
                if fields and fields[0] not in ("Z", "X"):
                    found.append(c)
                    todo.append(c)
        return found
    children: dict[int, list[int]] = {}
    for p in _pids():
        fields = _stat_fields(p)
        if fields and len(fields) >= 2 and fields[0] not in ("Z", "X"):
            children.setdefault(int(fields[1]), []).append(p)
    found, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


def _children(pid: int) -> list[int]:
    """pid's children: what each of its threads' /proc/<pid>/task/<tid>/children lists (a few reads for a process
    tree, where scanning every process's stat costs ~10 ms on a busy machine, and tests poll it)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            out += map(int, read_text(f"/proc/{pid}/task/{tid}/children", MAX_PROC_BYTES, "children list").split())
        except (OSError, QualError):
            continue
    return out


_CHILDREN_LISTED = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")  # CONFIG_PROC_CHILDREN


def alive(pid: int) -> bool:
    """pid exists and is not a zombie."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


@dataclass(frozen=True)
class Listener:
    """One listening TCP socket and the process holding it."""

    pid: int
    address: str  # "127.0.0.1", "::1", "0.0.0.0", "::", ...
    port: int

    @property
    def loopback(self) -> bool:
        ip = ipaddress.ip_address(self.address)
        mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is IPv4 loopback
        return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def _address(hex_addr: str) -> str:
    """/proc/net/tcp{,6} address text (host-order 32-bit words, hex) -> printable address."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word is little-endian
    return str(ipaddress.ip_address(words))


def _listening_inodes() -> dict[int, tuple[str, int]]:
    """inode -> (address, port) of every listening TCP socket in this network namespace."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = read_text(table, MAX_SOCKET_TABLE_BYTES, "socket table").splitlines()[1:]
        except (OSError, QualError):
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10 or cols[3] != _TCP_LISTEN:
                continue
            addr, port = cols[1].rsplit(":", 1)
            found[int(cols[9])] = (_address(addr), int(port, 16))
    return found


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        entries = os.scandir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    with entries:
        for e in entries:
            try:
                target = os.readlink(e.path)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


def listeners(pids: list[int]) -> list[Listener]:
    """The listening TCP sockets held by these processes (those whose /proc/<pid>/fd can be read)."""
    table = _listening_inodes()
    out = []
    for pid in pids:
        for inode in _socket_inodes(pid) & table.keys():
            out.append(Listener(pid, *table[inode]))
    return out


def port_listeners(port: int) -> list[tuple[str, int]]:
    """(address, inode) of every listening TCP socket on port, whoever holds it (empty without /proc)."""
    return [(addr, inode) for inode, (addr, p) in _listening_inodes().items() if p == port]


def holds_socket(pids: list[int], inodes: set[int]) -> bool:
    """Whether one of pids holds one of these socket inodes."""
    return any(_socket_inodes(pid) & inodes for pid in pids)


OUTER_TMPDIR = "QUAL_OUTER_TMPDIR"  # the temp directory outside a command's private one (PrivateTmp)
INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"  # torch.compile's cache of compiled graphs and kernels


def outer_tmpdir() -> str:
    """Where a file that must outlive this command goes when it has no output directory (a crash's traceback)."""
    import tempfile

    return os.environ.get(OUTER_TMPDIR) or tempfile.gettempdir()


# Unix sockets go in the temp directory (multiprocessing's pymp-*/listener-*, a vLLM server's ipc:// paths, about
# 50 bytes below it) and a socket's path holds at most 107 bytes: past this length the folder goes under /tmp.
SOCKET_SAFE_TMP_LEN = 48


def _short_private_dir(outer: str, prefix: str) -> str:
    """A new private folder under `outer` when sockets fit below it and it is writable, else under /tmp."""
    import tempfile

    for parent in dict.fromkeys([outer, "/tmp"] if len(outer) + len(prefix) + 8 <= SOCKET_SAFE_TMP_LEN else ["/tmp"]):
        try:
            return tempfile.mkdtemp(prefix=prefix, dir=parent)
        except OSError:
            continue
    raise QualError(f"no writable temporary directory: TMPDIR={outer} and /tmp both refused a new folder")


class PrivateTmp:
    """One temporary folder for everything this process and its children put in the temp directory
    (multiprocessing's pymp-*, the ranks' rendezvous, a vLLM server's IPC sockets): TMPDIR points into it, and it
    is removed on every exit path that can still run code: at interpreter exit, or by remove() before an os._exit.

    One per process (private_tmp()): multiprocessing keeps the temp folder it first used for the process's life, so
    a second command run in the same process (the tests call the CLI's main() in-process) must find the same one.
    """

    def __init__(self, prefix: str = "qual-"):
        import tempfile
        from multiprocessing import util

        outer = tempfile.gettempdir()
        os.environ.setdefault(OUTER_TMPDIR, outer)  # what outlives the command: crash files
        # torch.compile keeps its compiled graphs under the temp directory unless told otherwise: in the private one
        # every run would compile the compiled backends' steps again (about 25 s for the toy pair on a CPU)
        os.environ.setdefault(INDUCTOR_CACHE, str(cache_dir() / "torchinductor"))
        self.path = _short_private_dir(outer, prefix)
        os.environ["TMPDIR"] = self.path  # children (vLLM servers, the fork server) inherit it
        tempfile.tempdir = self.path  # and this process's own temporary files go there too
        # Removed at exit after multiprocessing's own finalizers (which remove its pymp-* folder inside this one, at
        # priority -100): the lowest priority runs last.
        util.Finalize(None, self.remove, exitpriority=-1000)

    def remove(self) -> None:
        remove_tree(self.path)


_PRIVATE_TMP: PrivateTmp | None = None


def private_tmp() -> PrivateTmp:
    """This process's private temporary folder, made on first use."""
    global _PRIVATE_TMP
    if _PRIVATE_TMP is None:
        _PRIVATE_TMP = PrivateTmp()
    return _PRIVATE_TMP
