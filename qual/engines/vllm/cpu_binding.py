"""Whether vLLM's CPU build can bind an arm's tensor-parallel ranks on this machine, said before a server starts.

Each CPU rank of vLLM's CPU build runs its OpenMP threads on cores of its own (vllm/utils/ompmultiprocessing.py).
qual gives each rank a core range (argv.server_env: VLLM_CPU_OMP_THREADS_BIND="0|1" for TP 2 on 2 cores) wherever
the cores allowed to it number at least TP; with fewer, the variable keeps vLLM's default "auto", under which each
rank takes a NUMA node of its own, and a server with more ranks than the NUMA nodes this process may allocate on
(/proc/self/status Mems_allowed_list, narrowed by CPU_VISIBLE_MEMORY_NODES) stops on vLLM's assertion "Not enough
allowed NUMA nodes to bind threads of N local CPUWorkers" some 30 s into its start: exit 3. An explicit binding
names one core range per rank ("|" between them), else vLLM's assertion on that stops it the same way. Both are
known from the arm, the environment and two files before anything starts. (VLLM_CPU_SIM_MULTI_NUMA, vLLM's switch
that simulates nodes, is not judged: a server with it set is left to start.)
"""

from __future__ import annotations

import os
from typing import Mapping

from qual.engines.vllm.argv import VllmOptions, server_env
from qual.errors import QualError
from qual.records import ArmConfig
from qual.userfiles import read_text

BIND = "VLLM_CPU_OMP_THREADS_BIND"
AUTO, NOBIND = "auto", "nobind"  # vLLM's default (a NUMA node a rank), and no binding at all
SIMULATED = "VLLM_CPU_SIM_MULTI_NUMA"  # vLLM's switch that splits one node's cores among the ranks instead
VISIBLE = "CPU_VISIBLE_MEMORY_NODES"


def allowed_numa_nodes(status: str = "/proc/self/status") -> list[int] | None:
    """The NUMA nodes this process may allocate on (Mems_allowed_list: '0-1,3'), None where that cannot be read."""
    try:
        text = read_text(status, 1 << 20, "process status")
    except (OSError, QualError):
        return None
    for line in text.splitlines():
        if line.startswith("Mems_allowed_list:"):
            return _id_list(line.partition(":")[2].strip())
    return None


def _id_list(text: str) -> list[int] | None:
    """'0-2,4' as [0, 1, 2, 4]; None where it is not such a list."""
    out: set[int] = set()
    try:
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        return None
    return sorted(out)


def tp_binding_problem(arm: ArmConfig, options: VllmOptions, numa_nodes: list[int] | None, cores: list[int],
                       environ: Mapping[str, str] = os.environ) -> str | None:
    """Why vLLM's CPU build would stop starting this arm's TP ranks here, one line (None: it would not, or it cannot
    be known). numa_nodes: allowed_numa_nodes(); cores: the cores this process may run on; environ: what the server
    inherits (argv.server_env and the profile's vllm.env are laid over it)."""
    if arm.device != "cpu":
        return None
    env = {**environ, **server_env(arm, options, cores)}
    bind = env.get(BIND, AUTO)
    if bind == NOBIND:
        return None
    if bind != AUTO:
        ranges = bind.split("|")
        if len(ranges) == arm.tp:
            return None
        return (f"vLLM: {BIND}={bind!r} names {len(ranges)} core range{'s' if len(ranges) != 1 else ''} for "
                f"{arm.tp} TP rank{'s' if arm.tp != 1 else ''} (--tp {arm.tp}): give one range per rank, '|' between them")
    if env.get(SIMULATED, "0") != "0" or numa_nodes is None:
        return None
    visible = numa_nodes
    if env.get(VISIBLE) and SIMULATED not in env:
        wanted = _id_list(env[VISIBLE])
        if wanted is None:
            return None  # vLLM's own error names it
        visible = [n for n in wanted if n in numa_nodes]
    if len(visible) >= arm.tp:
        return None
    most = max(len(visible), len(cores), 1)
    return (f"vLLM: --tp {arm.tp} on its CPU build binds each TP rank to a NUMA node of its own ({BIND}={AUTO}), and "
            f"this machine allows {len(visible)} (nodes {','.join(map(str, visible)) or 'none'}) with {len(cores)} "
            f"core{'s' if len(cores) != 1 else ''}, too few for a core range per rank: use --tp {most} or less, or "
            f"set {BIND} in the profile's vllm.env")
