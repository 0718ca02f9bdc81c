"""The `vllm serve` command line of one arm: profile `vllm:` options + ArmConfig -> argv and env."""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt, field_validator

from qual.records import ArmConfig
from qual.engines.vllm.install import REPO_ROOT, VllmInstall
from qual.errors import QualError
from qual.options import VllmDcpComm
from qual.redact import redact_env
from qual.validation import Section, parse_section

CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
PER_REQUEST_METRICS = ("auto", "none", "summary", "detailed")
PER_REQUEST_FLAG = "--per-request-spec-decode-metrics"
HOST = "127.0.0.1"
# Flags qual sets itself and a profile may not: where the server listens, and the key that proves it is ours
# (--config: a YAML file of flags, which could set any of them out of sight).
RESERVED_FLAGS = ("--host", "--port", "--api-key", "--uds", "--config")
# Environment qual sets itself: the server's API key, and loopback for its processes' own sockets.
RESERVED_ENV = ("VLLM_API_KEY", "VLLM_HOST_IP", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
LOOPBACK_ENV = {"VLLM_HOST_IP": HOST, "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def reserved_flag(arg: str) -> str | None:
    """The reserved flag an argument spells (vLLM accepts underscores and, through argparse, unambiguous
    prefixes: `--api_key`, `--ho`), or None."""
    if not arg.startswith("--"):
        return None
    name = arg.split("=", 1)[0].split(".", 1)[0].replace("_", "-")
    if len(name) <= 2:
        return None
    return next((flag for flag in RESERVED_FLAGS if flag == name or (len(name) >= 4 and flag.startswith(name))), None)


class VllmOptions(Section):
    """The `vllm:` section of a model profile (every key optional)."""

    python: str | None = None
    """The interpreter of the vLLM install to start (default: the checkout's .venv-vllm, then this one's)"""
    tokenizer: str | None = None
    """The server's tokenizer (default: the target)"""
    served_model_name: str | None = None
    """The name the server serves the model under (default: the profile's name)"""
    max_model_len: PositiveInt | None = None
    """--max-model-len (default: the profile's max_model_len)"""
    block_size: PositiveInt | None = None
    """--block-size: tokens a KV block holds"""
    max_num_seqs: PositiveInt | None = None
    """--max-num-seqs: requests a server batches"""
    attention_backend: str | None = None
    """--attention-backend (DCP needs one that returns the softmax LSE)"""
    dcp_comm_backend: VllmDcpComm | None = None
    """--dcp-comm-backend: ag_rs or a2a (passed only at DCP > 1)"""
    cudagraph_mode: str | None = None
    """The compilation config's cudagraph_mode: NONE, PIECEWISE, FULL, FULL_DECODE_ONLY or FULL_AND_PIECEWISE"""
    cudagraph_capture_sizes: list[PositiveInt] | None = None
    """The compilation config's cudagraph_capture_sizes (verify batches are K + 1 tokens a request: multiples of K + 1)"""
    enforce_eager: bool = False
    """--enforce-eager: no compilation and no CUDA graphs"""
    per_request_metrics: Literal[PER_REQUEST_METRICS] = "auto"
    """--per-request-spec-decode-metrics: auto (detailed where the install has the flag), none, summary or detailed"""
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """--gpu-memory-utilization: the share of each GPU's memory a server takes (vLLM's default 0.9)"""
    kv_cache_dtype: str | None = None
    """--kv-cache-dtype"""
    trust_remote_code: bool = False
    """--trust-remote-code"""
    speculative_config: dict = Field(default_factory=dict)
    """Keys merged into --speculative-config (method dflash, the drafter and K are qual's)"""
    extra_args: list[str] = Field(default_factory=list)
    """Further server flags, as they are (the listening address, API key and --revision are qual's and refused here)"""
    env: dict[str, str | int] = Field(default_factory=dict)
    """Environment of the server (a number is passed as its text); the API key and loopback settings are qual's"""
    startup_timeout_s: PositiveFloat = 900.0
    """Seconds a server may take to load and capture before the arm fails"""
    request_timeout_s: PositiveFloat = 600.0
    """Seconds one completion may take before the arm fails"""

    @field_validator("extra_args")
    @classmethod
    def _no_reserved_flags(cls, args: list[str]) -> list[str]:
        for arg in args:
            name = arg.split("=", 1)[0].replace("_", "-")
            if len(name) >= 5 and "--revision".startswith(name):  # argparse takes --rev for --revision
                raise ValueError(f"{arg[:40]} is refused: the profile's target_revision sets it (and provenance "
                                 "records it)")
            flag = reserved_flag(arg)
            if flag:
                raise ValueError(f"{arg[:40]} is refused: qual sets {flag} itself (the server listens on {HOST} "
                                 f"only, with a random API key)")
        return args

    @field_validator("env")
    @classmethod
    def _no_reserved_env(cls, env: dict) -> dict:
        for name in env:
            if str(name).upper() in RESERVED_ENV:
                raise ValueError(f"{str(name)[:40]} is refused: qual sets it itself (the server's API key, and loopback "
                                 f"for its sockets)")
        return env

    @field_validator("speculative_config")
    @classmethod
    def _no_draft_revision(cls, config: dict) -> dict:
        if "revision" in config:
            raise ValueError("revision is refused: the profile's draft_revision sets it (and provenance records it)")
        return config

    @field_validator("cudagraph_mode")
    @classmethod
    def _known_mode(cls, mode: str | None) -> str | None:
        if mode is not None and mode.upper() not in CUDAGRAPH_MODES:
            raise ValueError(f"not one of {', '.join(CUDAGRAPH_MODES)}")
        return mode

    def model_post_init(self, _context) -> None:
        if self.enforce_eager and self.cudagraph_mode not in (None, "NONE"):
            raise QualError("vllm.enforce_eager and vllm.cudagraph_mode both set: eager means no CUDA graphs")

    @classmethod
    def from_extra(cls, extra: dict | None) -> "VllmOptions":
        """Options from ArmConfig.extra: its "vllm" mapping (the profile's `vllm:` key), with the
        profile's top-level max_model_len and tokenizer as defaults; a bare mapping also works."""
        extra = dict(extra or {})
        nested = isinstance(extra.get("vllm"), dict)
        data = dict(extra["vllm"]) if nested else extra
        if nested:
            for key in ("max_model_len", "tokenizer"):
                if data.get(key) is None and extra.get(key) is not None:
                    data[key] = extra[key]
        return parse_section(cls, data, "the model profile", "vllm")

    @property
    def requested_cudagraph_mode(self) -> str | None:
        if self.enforce_eager:
            return "NONE"
        return self.cudagraph_mode.upper() if self.cudagraph_mode else None


def resolve_path(path: str, repo_root: Path = REPO_ROOT) -> str:
    """Absolute path for a repo-relative checkpoint directory; hub ids and absolute paths pass through."""
    p = Path(path)
    if not p.is_absolute() and (repo_root / p).exists():
        return str((repo_root / p).resolve())
    return path


def per_request_level(options: VllmOptions, install: VllmInstall | None, speculative: bool) -> str | None:
    """The --per-request-spec-decode-metrics level to pass, or None to leave the flag out."""
    if not speculative or options.per_request_metrics == "none":
        return None
    supported = install is not None and install.has_flag(PER_REQUEST_FLAG)
    if options.per_request_metrics == "auto":
        return "detailed" if supported else None
    if not supported:
        raise QualError(f"vllm.per_request_metrics={options.per_request_metrics} but the installed vLLM has no {PER_REQUEST_FLAG}")
    return options.per_request_metrics


def serve_args(arm: ArmConfig, options: VllmOptions, port: int, install: VllmInstall | None,
               repo_root: Path = REPO_ROOT) -> list[str]:
    """Arguments after the launcher (`vllm serve` or the api_server module) for one arm."""
    target = resolve_path(arm.target_path, repo_root)
    positional = install is None or install.model_is_positional
    args = [target] if positional else ["--model", target]
    args += [
        "--tokenizer", resolve_path(options.tokenizer, repo_root) if options.tokenizer else target,
        "--served-model-name", options.served_model_name or arm.model,
        "--host", HOST,
        "--port", str(port),
        "--seed", str(arm.sampling.seed),
        "--dtype", arm.dtype,
        "--tensor-parallel-size", str(arm.tp),
    ]
    if arm.extra.get("target_revision"):
        args += ["--revision", arm.extra["target_revision"]]
    # DCP flags only when they say something, so builds without them still parse a DCP1 arm.
    if arm.dcp > 1 or arm.interleave > 1:
        args += ["--decode-context-parallel-size", str(arm.dcp),
                 "--cp-kv-cache-interleave-size", str(arm.interleave)]
        if options.dcp_comm_backend:
            args += ["--dcp-comm-backend", options.dcp_comm_backend]
    if options.max_model_len is not None:
        args += ["--max-model-len", str(options.max_model_len)]
    if options.block_size is not None:
        args += ["--block-size", str(options.block_size)]
    if options.max_num_seqs is not None:
        args += ["--max-num-seqs", str(options.max_num_seqs)]
    if options.attention_backend:
        args += ["--attention-backend", options.attention_backend]
    if options.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", str(options.gpu_memory_utilization)]
    if options.kv_cache_dtype:
        args += ["--kv-cache-dtype", options.kv_cache_dtype]
    if options.trust_remote_code:
        args.append("--trust-remote-code")
    speculative = arm.draft_path is not None
    if speculative:
        spec = {"method": "dflash", "model": resolve_path(arm.draft_path, repo_root),
                "num_speculative_tokens": arm.num_speculative_tokens, **options.speculative_config}
        if arm.extra.get("draft_revision"):
            spec["revision"] = arm.extra["draft_revision"]
        args += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    if options.enforce_eager:
        args.append("--enforce-eager")
    elif options.cudagraph_mode or options.cudagraph_capture_sizes:
        cc: dict = {}
        if options.cudagraph_mode:
            cc["cudagraph_mode"] = options.cudagraph_mode.upper()
        if options.cudagraph_capture_sizes:
            cc["cudagraph_capture_sizes"] = list(options.cudagraph_capture_sizes)
        args += ["--compilation-config", json.dumps(cc, separators=(",", ":"))]
    level = per_request_level(options, install, speculative)
    if level:
        args += [PER_REQUEST_FLAG, level]
    return args + list(options.extra_args)


def cpu_thread_binding(tp: int, cores: list[int]) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for tp CPU ranks: disjoint core ranges, "0|1" for 2 ranks on 2 cores."""
    if tp <= 1 or len(cores) < tp:
        return None  # one rank binds itself; fewer cores than ranks cannot be split
    per = len(cores) // tp
    chunks = [cores[i * per : (i + 1) * per] for i in range(tp)]
    return "|".join(str(c[0]) if len(c) == 1 else f"{c[0]}-{c[-1]}" for c in chunks)


def server_env(arm: ArmConfig, options: VllmOptions, cores: list[int] | None = None) -> dict[str, str]:
    """Environment additions for the server (the caller layers them over os.environ)."""
    env = {"HF_HUB_OFFLINE": "1", **LOOPBACK_ENV}  # checkpoints are local; never reach for a hub mid-run
    if arm.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB; the default would claim a large share of RAM
        binding = cpu_thread_binding(arm.tp, sorted(cores if cores is not None else os.sched_getaffinity(0)))
        if binding:  # TP on CPU needs one core range per rank (docs/vllm.md: TP 2 works with "0|1")
            env["VLLM_CPU_OMP_THREADS_BIND"] = binding
    env.update({str(k): str(v) for k, v in options.env.items()})
    return env


@dataclass(frozen=True)
class ServeCommand:
    """A full server command: argv and the environment additions it needs."""

    argv: list[str]
    env: dict[str, str]

    def shell(self) -> str:
        """One copy-pasteable line (for --dry-run, reports and the log header); secret env values redacted."""
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(redact_env(self.env).items()))
        return (prefix + " " if prefix else "") + shlex.join(self.argv)


def serve_command(arm: ArmConfig, options: VllmOptions, port: int, install: VllmInstall | None,
                  repo_root: Path = REPO_ROOT) -> ServeCommand:
    """The launcher plus serve_args, and server_env."""
    launcher = install.launcher() if install is not None else ["vllm", "serve"]
    return ServeCommand(launcher + serve_args(arm, options, port, install, repo_root), server_env(arm, options))
