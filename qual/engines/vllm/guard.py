"""Start a command that cannot outlive qual: `python guard.py FD -- COMMAND...` (stdlib only, run by path).

This process execs COMMAND, so the server keeps this pid, its exit status and its process group. Before that it
forks a watchdog into the same group, which blocks on FD: the read end of a pipe whose only write end the qual
driver holds. When the driver goes away (exit, crash, kill -9) the pipe reads end-of-file and the watchdog
SIGKILLs the whole group: api_server, EngineCore and workers, which hold GPU memory on a real node. vLLM's own
processes do not watch the api_server's parent, and a parent-death signal would reach the api_server alone.
"""

from __future__ import annotations

import os
import select
import signal
import sys

POLL_S = 0.5  # how often the watchdog checks that the server (its parent) still runs


def watch(fd: int, leader: int) -> None:
    """Kill the process group when fd reads end-of-file; return once the leader is gone."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # qual's stop() signals the group: the server answers, not this
    while os.getppid() == leader:
        readable, _, _ = select.select([fd], [], [], POLL_S)
        if readable and not os.read(fd, 64):
            os.killpg(os.getpgrp(), signal.SIGKILL)


def main(argv: list[str]) -> None:
    if len(argv) < 4 or argv[2] != "--":
        sys.exit("usage: guard.py FD -- COMMAND...")
    fd, command = int(argv[1]), argv[3:]
    leader = os.getpid()
    if os.fork() == 0:
        try:
            watch(fd, leader)
        finally:
            os._exit(0)
    os.close(fd)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"qual guard: cannot execute {command[0]}: {exc.strerror}", file=sys.stderr, flush=True)
        os._exit(127)


if __name__ == "__main__":
    main(sys.argv)
