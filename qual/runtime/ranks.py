"""Ranks 1 .. world - 1 as processes: started, waited for until they reach the rendezvous, stopped or killed.

Rank 0 is the driver's own process (qual/runtime/engine.py). On CPU the ranks are forked by the fork server that
preloaded torch and the runtime, on CUDA spawned (qual/runtime/launch.py). A rank dies with the driver, whatever
kills the driver (qual/proc.py).
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from contextlib import nullcontext
from pathlib import Path

from qual.errors import EngineError, QualError
from qual.proc import die_with_parent
from qual.runtime.config import EngineConfig
from qual.runtime.launch import (adopt_environment, environment, forked_by_server, ignored_by_children,
                                 rank_context)
from qual.runtime.model_runner import ModelRunner
from qual.runtime.parallel import Rendezvous, abort_comm, arm_hang_dump, init_comm, set_cpu_threads, shutdown_comm
from qual.stop_signals import STOP_SIGNALS

# Seconds to wait for ranks that were told to stop (a clean close) before they are killed.
STOP_JOIN_S = 30.0
# How often the driver looks at the ranks while they start.
_START_POLL_S = 0.05


def _worker_main(rank: int, cfg: EngineConfig, specs: tuple, rendezvous_dir: str, init_method: str, driver_pid: int,
                 via_server: bool, env: dict | None) -> None:
    """A rank's whole life: join the process group, build its runner, execute the driver's steps until told to stop."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)  # already, from the driver (ignored_by_children); said again here
    die_with_parent(driver_pid, via_server=via_server)  # a killed driver (kill -9, OOM) takes its ranks with it
    adopt_environment(env)
    try:
        arm_hang_dump()
        set_cpu_threads(cfg.parallel.world_size, cfg.threads_per_rank)
        Path(rendezvous_dir, f"ready.{rank}").touch()  # imports done: rank 0 may enter the rendezvous now
        comm = init_comm(rank, cfg.parallel, init_method, cfg.device, cfg.dist_timeout_s)
        runner = ModelRunner(cfg, comm, *specs)
        while (step := comm.broadcast_object(None)) is not None:
            runner.execute(step)
        runner.close()
        shutdown_comm(comm)
    except QualError as exc:  # a checkpoint or option problem: rank 0 meets it too; one line, no traceback
        print(f"rank {rank}: error: {exc}", file=sys.stderr, flush=True)
        os._exit(1)
    except Exception:
        # The driver stopped (a signal, an error) and removed the rendezvous while this rank started or ran: it says
        # why; this rank's failure to reach the rendezvous is that stop, not a second error (stderr stays quiet).
        if Path(rendezvous_dir).is_dir():
            traceback.print_exc()
        os._exit(1)  # a dead peer fails rank 0's next collective at once
    # Done: skip interpreter teardown. Gloo's threads can still hold tensors then, and destroying them aborted
    # about one worker in six ("terminate called without an active exception", exit code -6) after a clean run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class Ranks:
    """The processes of ranks 1 .. world - 1 of one engine, and the rendezvous they meet rank 0 at."""

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.workers: list = []
        self.rendezvous = Rendezvous()

    def start(self, specs: tuple) -> None:
        """Start ranks 1 .. world - 1 (a one-rank engine starts no process, nor a fork server)."""
        cfg, world = self.cfg, self.cfg.parallel.world_size
        if world == 1:
            return
        ctx = rank_context(cfg.device)  # a CPU engine's fork server starts here (if no preflight started it)
        forked = forked_by_server(ctx)
        args = (cfg, specs, self.rendezvous.dir, self.rendezvous.init_method, os.getpid(), forked, environment(ctx))
        # Forked ranks take the server's dispositions, so they start outside: the first start waits for the server's
        # imports, and an interrupt meanwhile is handled at once. Spawned ranks take this process's.
        with nullcontext() if forked else ignored_by_children(STOP_SIGNALS):
            for r in range(1, world):
                p = ctx.Process(target=_worker_main, args=(r, *args), daemon=True)
                p.start()
                self.workers.append(p)

    def wait_ready(self) -> None:
        """Wait, interruptibly, until every rank reached its rendezvous; a rank that died is an EngineError now.

        Rank 0 then enters a rendezvous that completes at once, instead of blocking in C++ (deaf to signals)
        while the ranks import torch, and for the whole process-group timeout if one of them died doing so.
        """
        deadline = time.monotonic() + self.cfg.dist_timeout_s
        pending = {r: p for r, p in enumerate(self.workers, 1)}
        while pending:
            for r, p in list(pending.items()):
                if Path(self.rendezvous.dir, f"ready.{r}").exists():
                    del pending[r]
                elif p.exitcode is not None:
                    raise EngineError(f"rank {r} exited during start (exit code {p.exitcode})")
            if pending and time.monotonic() > deadline:
                raise EngineError(f"ranks {sorted(pending)} did not start within {self.cfg.dist_timeout_s:.0f} s")
            if pending:
                time.sleep(_START_POLL_S)

    def stop(self, comm, runner) -> None:
        """A clean stop, between steps: every rank leaves its loop at the driver's None, then its process ends."""
        comm.broadcast_object(None)
        runner.close()
        shutdown_comm(comm)
        for p in self.workers:
            p.join(timeout=STOP_JOIN_S)

    def abort(self, comm=None) -> None:
        """Kill whatever still runs, drop rank 0's side of the process group without a collective, and remove the
        rendezvous."""
        for p in self.workers:
            if p.is_alive():
                p.kill()
        for p in self.workers:
            p.join(timeout=5)
        if comm is not None:
            abort_comm(comm)
        self.rendezvous.close()
