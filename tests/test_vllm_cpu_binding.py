"""qual.engines.vllm.cpu_binding: which CPU arms vLLM's CPU build cannot bind, said before a server starts, against
vLLM's own binding code (vllm/utils/ompmultiprocessing.py in .venv-vllm; the oracle is skipped without it)."""

from __future__ import annotations

import itertools
import json
import subprocess

import pytest

from qual.engines.vllm import cpu_binding
from qual.engines.vllm.argv import VllmOptions, server_env
from qual.engines.vllm.engine import VllmEngine
from qual.engines.vllm.install import DEFAULT_VENV, REPO_ROOT
from qual.records import ArmConfig, Sampling

VENV_PYTHON = REPO_ROOT / DEFAULT_VENV / "bin" / "python"
BIND, SIM, VISIBLE = cpu_binding.BIND, cpu_binding.SIMULATED, cpu_binding.VISIBLE

# vLLM's OMPProcessManager for each case: the cores and NUMA nodes it reads patched to the case's, the environment
# the server would get; prints whether it stopped on its assertion
_ORACLE = """
import json, os, sys
import vllm.utils.cpu_resource_utils as cr
from types import SimpleNamespace
from vllm.utils.cpu_resource_utils import LogicalCPUInfo
from vllm.utils.ompmultiprocessing import OMPProcessManager

out = []
for case in json.loads(sys.stdin.read()):
    for name in case["unset"]:
        os.environ.pop(name, None)
    os.environ.update(case["env"])
    nodes, cores = case["numa"], case["cores"]
    cr.get_memory_affinity = lambda pid=0, nodes=nodes: list(nodes)
    cr.get_allowed_cpu_list = lambda cores=cores, nodes=nodes: [
        LogicalCPUInfo(c, c, nodes[i % len(nodes)]) for i, c in enumerate(cores)]
    # without data parallelism a server's engine core leaves data_parallel_rank_local None (vllm/v1/engine/core.py)
    parallel = SimpleNamespace(local_world_size=case["tp"], data_parallel_rank_local=None, _api_process_count=1)
    try:
        OMPProcessManager(SimpleNamespace(parallel_config=parallel, kv_transfer_config=None))
        out.append(None)
    except AssertionError as exc:
        out.append((str(exc) or "assertion").splitlines()[0])
print(json.dumps(out))
"""


def _arm(tp: int, device: str = "cpu", dcp: int = 1, **env) -> ArmConfig:
    return ArmConfig(engine="vllm", model="m", dcp=dcp, tp=tp, draft_kv="replicated", target_path="/t",
                     draft_path="/d", num_speculative_tokens=7, sampling=Sampling(0.0, 3, 16), device=device,
                     extra={"vllm": {"env": env} if env else {}, "max_model_len": 1024, "tokenizer": "/tok"})


# (VLLM_CPU_SIM_MULTI_NUMA, vLLM's switch for simulating nodes, is left out: without data parallelism vLLM 0.32 stops
# on it at every TP size, an assertion of its own that the check does not judge)
ENVIRONS = [{}, {BIND: "auto"}, {BIND: "nobind"}, {BIND: "0|1"}, {BIND: "0-3|4-7"}, {VISIBLE: "0"}, {VISIBLE: "0,1"}]
CASES = [dict(tp=tp, cores=cores, numa=numa, environ=environ)
         for tp, cores, numa, environ in itertools.product((1, 2, 3, 4), ([0, 1], list(range(8))), ([0], [0, 1],
                                                           [0, 1, 2, 3]), ENVIRONS)]


@pytest.mark.skipif(not VENV_PYTHON.exists(), reason="no .venv-vllm")
def test_the_check_says_a_problem_exactly_where_vllms_binding_stops():
    """Over TP sizes, core counts, NUMA layouts and the binding variables a user may set: qual names a problem before
    the start exactly where vLLM's own OMPProcessManager, given the environment the server would get, stops."""
    arms = [(case, _arm(case["tp"])) for case in CASES]
    envs = [{**case["environ"], **server_env(arm, VllmOptions(), case["cores"])} for case, arm in arms]
    keep = (BIND, SIM, VISIBLE)
    payload = [{"tp": case["tp"], "cores": case["cores"], "numa": case["numa"], "unset": list(keep),
                "env": {k: v for k, v in env.items() if k in keep}} for (case, _), env in zip(arms, envs)]
    proc = subprocess.run([str(VENV_PYTHON), "-c", _ORACLE], input=json.dumps(payload), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    stopped = json.loads(proc.stdout.strip().splitlines()[-1])
    said = [cpu_binding.tp_binding_problem(arm, VllmOptions(), case["numa"], case["cores"], case["environ"])
            for case, arm in arms]
    assert sum(s is not None for s in stopped) >= 10  # the matrix reaches vLLM's refusals, not only its starts
    mismatched = [(case, vllm, ours) for case, vllm, ours in zip(CASES, stopped, said) if (vllm is None) != (ours is None)]
    assert mismatched == []


def test_the_machine_check_names_it_in_one_line_before_anything_starts(monkeypatch):
    """VllmEngine.missing (what `qual run` refuses with before an arm runs, and --dry-run lists) names TP 4 on two
    cores and one NUMA node; an arm that never starts (DCP > 1 on a CPU: not runnable) and a CUDA arm are not named."""
    monkeypatch.setattr(cpu_binding, "read_text", lambda *a: "Name:\tx\nMems_allowed_list:\t0\n")
    monkeypatch.setattr("qual.engines.vllm.engine.os.sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv(BIND, raising=False)
    monkeypatch.delenv(SIM, raising=False)
    monkeypatch.delenv(VISIBLE, raising=False)
    engine = VllmEngine()
    problems = engine.missing([_arm(4)])
    named = [p for p in problems if "NUMA" in p]
    assert named == ["vLLM: --tp 4 on its CPU build binds each TP rank to a NUMA node of its own "
                     "(VLLM_CPU_OMP_THREADS_BIND=auto), and this machine allows 1 (nodes 0) with 2 cores, too few for "
                     "a core range per rank: use --tp 2 or less, or set VLLM_CPU_OMP_THREADS_BIND in the profile's "
                     "vllm.env"]
    assert not [p for p in engine.missing([_arm(2), _arm(4, dcp=2)]) if "NUMA" in p or "core range" in p]
    assert [p for p in engine.missing([_arm(2, **{BIND: "0"})]) if "core range" in p] == [
        "vLLM: VLLM_CPU_OMP_THREADS_BIND='0' names 1 core range for 2 TP ranks (--tp 2): give one range per rank, "
        "'|' between them"]


def test_allowed_numa_nodes_reads_the_kernels_list(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tqual\nMems_allowed:\t00000003\nMems_allowed_list:\t0-1,3\n")
    assert cpu_binding.allowed_numa_nodes(str(status)) == [0, 1, 3]
    status.write_text("Name:\tqual\n")
    assert cpu_binding.allowed_numa_nodes(str(status)) is None
    assert cpu_binding.allowed_numa_nodes(str(tmp_path / "none")) is None
    assert cpu_binding.allowed_numa_nodes()  # this process's own: at least the node it runs on
