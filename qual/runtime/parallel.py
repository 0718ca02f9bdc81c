"""Process groups and the few collectives the models need; each is a no-op for a group of one."""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from qual.files import remove_tree
from qual.options import DEFAULT_DCP_COMM
from qual.runtime.config import ParallelConfig, hang_dump_seconds

# The ranks' own TCP links (gloo pairs, NCCL bootstrap) bind this interface: every rank is on one host, and the
# libraries' default (the address the host name resolves to) can be one the network reaches.
LOOPBACK_IFNAME = "lo" if sys.platform.startswith("linux") else "lo0"
_LOOPBACK_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class Rendezvous:
    """Where the ranks of one engine meet: a torch.distributed FileStore in a private (0700) temporary directory.

    A file, not a TCP store: nothing listens for it, and only this user can reach the objects the ranks pickle
    to one another through the process group it sets up.
    """

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="qual-rdzv-")  # mode 0700
        self.init_method = f"file://{os.path.join(self.dir, 'store')}"

    def close(self) -> None:
        remove_tree(self.dir)


def bind_loopback() -> None:
    """Make this process's gloo and NCCL sockets bind the loopback interface (read when a group is created)."""
    for name in _LOOPBACK_ENV:
        os.environ[name] = LOOPBACK_IFNAME


@dataclass
class Comm:
    """This rank's place in the TP group and its DCP sub-group."""

    rank: int = 0
    tp_size: int = 1
    dcp_size: int = 1
    tp_group: object | None = None
    dcp_group: object | None = None
    device: torch.device = torch.device("cpu")
    dcp_comm: str = DEFAULT_DCP_COMM  # how DCP partial attention results are merged (qual.options.DCP_COMM_MODES)
    interleave: int = 1  # consecutive positions one DCP rank stores (cp_kv_cache_interleave_size)

    @property
    def tp_rank(self) -> int:
        return self.rank

    @property
    def dcp_rank(self) -> int:
        return self.rank % self.dcp_size

    def all_reduce_tp(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather_dcp(self, x: torch.Tensor) -> torch.Tensor:
        """Stack every DCP rank's x: [dcp, *x.shape] (rank order)."""
        if self.dcp_size == 1:
            return x.unsqueeze(0)
        parts = [torch.empty_like(x) for _ in range(self.dcp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.dcp_group)
        return torch.stack(parts)

    def all_to_all_dcp(self, x: torch.Tensor) -> torch.Tensor:
        """x [dcp, ...]: slice j goes to DCP rank j; returns [dcp, ...] with slice j from rank j."""
        if self.dcp_size == 1:
            return x
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=self.dcp_group)
        return out

    def reduce_scatter_dcp(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x [dcp * n, ...] over the DCP group and keep this rank's slice n."""
        if self.dcp_size == 1:
            return x
        chunks = x.shape[0] // self.dcp_size
        if self.device.type == "cuda":
            out = torch.empty((chunks, *x.shape[1:]), dtype=x.dtype, device=x.device)
            dist.reduce_scatter_tensor(out, x.contiguous(), group=self.dcp_group)
            return out
        # gloo has no reduce_scatter: all-reduce and keep our slice.
        x = x.contiguous()
        dist.all_reduce(x, group=self.dcp_group)
        return x[self.dcp_rank * chunks : (self.dcp_rank + 1) * chunks]

    def broadcast_object(self, obj=None):
        """Rank 0's object on every rank."""
        if self.tp_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.tp_group)
        return box[0]

    def broadcast_tensor(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.broadcast(x, src=0, group=self.tp_group)
        return x


def init_comm(rank: int, parallel: ParallelConfig, init_method: str, device: str, timeout_s: float) -> Comm:
    """Join the process group and build the DCP sub-groups (consecutive ranks)."""
    tp_size, dcp_size = parallel.tp, parallel.dcp
    if device.startswith("cuda"):
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    else:
        dev = torch.device("cpu")
    if tp_size == 1:
        return Comm(device=dev, dcp_comm=parallel.dcp_comm, interleave=parallel.interleave)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    bind_loopback()
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=tp_size, timeout=timedelta(seconds=timeout_s)
    )
    dcp_group = None
    for start in range(0, tp_size, dcp_size):
        group = dist.new_group(list(range(start, start + dcp_size)))  # every rank must create every group
        if start <= rank < start + dcp_size:
            dcp_group = group
    return Comm(rank, tp_size, dcp_size, dist.group.WORLD, dcp_group, dev, parallel.dcp_comm, parallel.interleave)


def shutdown_comm(comm: Comm) -> None:
    if comm.tp_size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def abort_comm(comm: Comm) -> None:
    """Leave the process group after its peers were killed: nothing waits for them (NCCL aborts its comms)."""
    if comm.tp_size == 1 or not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if comm.device.type == "cuda" and abort is not None:
        abort()
    else:
        dist.destroy_process_group()


def arm_hang_dump() -> None:
    """QUAL_HANG_DUMP_S=N: print every thread's stack to stderr every N seconds (where did a rank hang?)."""
    seconds = hang_dump_seconds()
    if seconds is not None:
        import faulthandler

        faulthandler.dump_traceback_later(seconds, repeat=True)


def set_cpu_threads(world_size: int, threads: int | None) -> None:
    """Share the cores among ranks so they do not oversubscribe the machine."""
    n = threads or max(1, (os.cpu_count() or 1) // world_size)
    torch.set_num_threads(n)
