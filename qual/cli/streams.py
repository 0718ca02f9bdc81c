"""The standard streams a command writes to. One closed when qual started (`qual schema >&-`, where Python leaves
sys.stdout None) becomes /dev/null: the command does its work, its output is dropped, its exit code is its own. A
stdout that refuses a write (a full disk, /dev/full) is one line and exit 2, as an output file that cannot be written
is (qual.files.WriteError); a reader that went away stays EPIPE, which qual.cli.main answers with exit 141."""

from __future__ import annotations

import errno
import io
import os
import sys

from qual.errors import QualError


class StdoutError(QualError):
    """stdout refused a write for another cause than a closed pipe: exit 2."""

    def __init__(self, exc: OSError):
        super().__init__(f"cannot write to stdout: {exc.strerror or exc}")


class StdoutClosed(BrokenPipeError):
    """stdout's reader went away (`qual run ... | head`): exit 141, never a bug's exit 4 (qual.cli.crash lets it
    through), and told apart from a closed socket to a server, which is the engine's."""


class _Stdout(io.TextIOWrapper):
    """sys.stdout's text layer over the same buffer, whose write errors are told apart from any other OSError (a
    bug's, exit 4). After the first refusal it drops what it is given: the exit flushes must not fail again."""

    refused = False

    def write(self, text: str) -> int:
        if self.refused:
            return len(text)
        try:
            return super().write(text)
        except OSError as exc:
            self._refuse(exc)

    def flush(self) -> None:
        if self.refused:
            return
        try:
            super().flush()
        except OSError as exc:
            self._refuse(exc)

    def _refuse(self, exc: OSError) -> None:
        self.refused = True
        if exc.errno == errno.EPIPE:
            raise StdoutClosed(exc.errno, exc.strerror) from None
        raise StdoutError(exc) from None


def prepare() -> None:
    """Closed stdout or stderr to /dev/null; stdout's write errors told apart (the console entry calls this first)."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        if getattr(sys, name) is None:
            setattr(sys, name, _null_stream(fd))
    out = sys.stdout
    # Only the interpreter's own: /dev/null refuses nothing, and a test's capture stays. sys.__stdout__ keeps `out`,
    # whose collection would close the buffer both share.
    if out is sys.__stdout__ and type(out) is io.TextIOWrapper:
        sys.stdout = _Stdout(out.buffer, encoding=out.encoding, errors=out.errors, newline="\n",
                             line_buffering=out.line_buffering, write_through=out.write_through)


def _null_stream(fd: int) -> io.TextIOWrapper:
    """/dev/null on fd, where it is still closed: a file opened later would otherwise take the descriptor, and what
    children and C libraries write to it would land in that file."""
    try:
        os.fstat(fd)
    except OSError:
        null = os.open(os.devnull, os.O_WRONLY)
        if null != fd:
            os.dup2(null, fd)  # inheritable, as dup2 makes it
            os.close(null)
        else:
            os.set_inheritable(fd, True)  # rank processes and servers write to it too
        return open(fd, "w", closefd=False)
    return open(os.devnull, "w")  # fd was taken since the interpreter started: leave it to its owner


def say(line: str) -> None:
    """One line on stderr; a stderr that refuses it (full, gone) loses the line, never the exit code."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
