"""Where an engine's rank processes come from: forked by a server that imported torch and the runtime once (CPU),
or spawned (CUDA).

Spawned ranks each import torch and the runtime from scratch: seconds of CPU apiece, and on a small machine the
ranks of one engine do it at once. A fork server (multiprocessing "forkserver") does it once per driver process,
before it forks anything, and serves every engine the driver builds. Forking is safe there because the server
runs no torch operation: torch's OpenMP and MKL pools start at the first parallel operation (each rank's own
set_cpu_threads and steps), and the one pool the imports start, numpy's OpenBLAS, is stopped by OpenBLAS's fork
handler before the first fork; the server then runs one thread (tests/test_rank_processes.py).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from contextlib import contextmanager
from multiprocessing import forkserver
from multiprocessing.context import BaseContext
from typing import Iterator

from qual.stop_signals import STOP_SIGNALS
from qual.runtime.registry import DRAFTERS, TARGETS

_MODELS = sorted({ref.split(":")[0] for ref in (*TARGETS.values(), *DRAFTERS.values())})
# rank_server first: the server arms its parent-death signal before the seconds the imports take.
PRELOAD = ["qual.runtime.rank_server", "qual.runtime.engine", *_MODELS]
# The driver alone decides when ranks stop: a Ctrl-C to the terminal's process group, or a CI job's SIGTERM to the
# run's group, reaches rank 0, which then kills the ranks. The ranks ignore both from the moment they exist.


@contextmanager
def ignored_by_children(signals: set) -> Iterator[None]:
    """Processes started inside ignore these signals from their first instruction; this one keeps them.

    An ignored disposition survives exec (a handler would not, and the signal mask does not survive
    multiprocessing's spawn), so a Ctrl-C while a rank imports torch prints no KeyboardInterrupt there. The CPU
    ranks' fork server (rank_context) starts here too: it ignores both, and so does every rank it
    forks. The signals are blocked first: one that arrives then stays pending (Linux does not discard a blocked signal,
    ignored or not) and reaches this process's own handler once both are restored; only one in the instant
    between blocking and ignoring is lost. Signal dispositions belong to the main thread: elsewhere the ranks
    rely on their own first lines (_worker_main).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def rank_context(device: str) -> BaseContext:
    """The multiprocessing context an engine on device starts its ranks with (for CPU, with its server started).

    The first call starts the server, inside ignored_by_children: it is a process of the driver's group, and keeps
    the dispositions it starts with (its ranks too). A real run's preflight calls it early, so that the server's
    imports (torch and the runtime, ~2 s on 2 cores) run while the driver imports its own and reads the corpus. Its parent-death signal follows the driver thread that started
    it: should that thread end, the server goes (and the ranks it forked); the next engine starts another.
    CUDA ranks keep spawn: a CUDA rank's start-up is its CUDA context and graph capture more than its imports,
    and ranks forked from a server that preloaded the runtime have not been run on a GPU machine.
    """
    if device.startswith("cuda"):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: the first CPU engine of this process
    with ignored_by_children(STOP_SIGNALS):
        forkserver.ensure_running()
    return ctx


def forked_by_server(ctx: BaseContext) -> bool:
    """Whether ranks of ctx are the server's children (the driver is their grandparent) rather than the driver's."""
    return ctx.get_start_method() == "forkserver"


def environment(ctx: BaseContext) -> dict[str, str] | None:
    """What a rank of ctx must adopt first (adopt_environment): the driver's environment now, where the rank's own
    would be the server's as the server started (QUAL_HANG_DUMP_S, torch's and gloo's variables set since)."""
    return dict(os.environ) if forked_by_server(ctx) else None


def adopt_environment(env: dict[str, str] | None) -> None:
    """In a rank: take the driver's environment (None: a spawned rank has it already). What the server's imports
    read (the OpenMP runtime's OMP_* at load) stays as the server read it."""
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
