"""What a running vLLM server says about itself: /version, /v1/models, /metrics, /server_info and one probe reply.

vLLM 0.32 exposes its configuration unevenly (docs/vllm.md, "Attach mode"): /version gives the version only; a
completion's system_fingerprint gives the version and, where above 1, the TP/PP/DP sizes; /metrics gives the
spec-decode series (so K) and the cache config; /server_info (only with VLLM_SERVER_DEV_MODE=1) gives the whole
config: parallel (DCP included), speculative, dtype, CUDA-graph settings, and the host's torch, CUDA and GPUs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from qual.engines.vllm.client import ClientError, VllmClient
from qual.engines.vllm.metrics import ACCEPTED_PER_POS, parse_samples
from qual.engines.vllm.transport import one_line
from qual.records import HostFacts

CACHE_INFO = "vllm:cache_config_info"
_FINGERPRINT = re.compile(r"^vllm-(?P<version>[^-]+)(?P<parallel>(?:-(?:tp|pp|dp)\d+|-ep)*)-(?P<hash>[0-9a-z]{8}|nohash)$")


@dataclass
class ServerFacts:
    """One server's answers; None (or empty) where an endpoint is absent or says nothing."""

    url: str
    version: str | None = None  # /version
    models: list[dict] = field(default_factory=list)  # /v1/models: id, root, max_model_len
    fingerprint: str | None = None  # the probe reply's system_fingerprint
    # A one-token reply's metrics.speculative_decoding: present where the server sends per-request metrics.
    probe_spec_decode: dict | None = None
    metrics_k: int | None = None  # draft positions in /metrics' per-position series
    cache_config: dict = field(default_factory=dict)  # /metrics vllm:cache_config_info labels
    server_info: dict | None = None  # /server_info?config_format=json (VLLM_SERVER_DEV_MODE=1 only)

    @property
    def per_request_metrics(self) -> bool:
        return self.probe_spec_decode is not None

    def config(self, section: str) -> dict:
        """A section of /server_info's vllm_config ({} where absent)."""
        cfg = (self.server_info or {}).get("vllm_config")
        value = cfg.get(section) if isinstance(cfg, dict) else None
        return value if isinstance(value, dict) else {}

    def reported(self) -> dict[str, tuple[object, str]]:
        """What the server states about the knobs an arm declares: name -> (value, where it said so)."""
        out: dict[str, tuple[object, str]] = {}
        parallel, spec, model = self.config("parallel_config"), self.config("speculative_config"), self.config("model_config")
        if "decode_context_parallel_size" in parallel:
            out["dcp"] = (parallel["decode_context_parallel_size"], "/server_info")
        interleave = parallel.get("dcp_kv_cache_interleave_size", parallel.get("cp_kv_cache_interleave_size"))
        if interleave is not None:
            out["interleave"] = (interleave, "/server_info")
        if "tensor_parallel_size" in parallel:
            out["tp"] = (parallel["tensor_parallel_size"], "/server_info")
        else:
            tp = _fingerprint_tp(self.fingerprint)
            if tp is not None:  # only stated where TP > 1; its absence proves nothing (--fingerprint-mode hash)
                out["tp"] = (tp, "system_fingerprint")
        if isinstance(model.get("dtype"), str):
            out["dtype"] = (model["dtype"].removeprefix("torch."), "/server_info")
        if "num_speculative_tokens" in spec:
            out["num_speculative_tokens"] = (spec["num_speculative_tokens"], "/server_info")
        elif self.probe_spec_decode and "num_spec_tokens" in self.probe_spec_decode:
            out["num_speculative_tokens"] = (self.probe_spec_decode["num_spec_tokens"], "per-request metrics")
        elif self.metrics_k:
            out["num_speculative_tokens"] = (self.metrics_k, "/metrics")
        if "method" in spec:
            out["speculative_method"] = (spec["method"], "/server_info")
        return out

    def summary(self) -> dict:
        """The facts worth keeping in result.json (no secrets: /server_info's environment is left out)."""
        compilation, model, spec = self.config("compilation_config"), self.config("model_config"), self.config("speculative_config")
        parallel = {k: v for k, v in self.config("parallel_config").items()
                    if k in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                             "decode_context_parallel_size", "dcp_kv_cache_interleave_size", "dcp_comm_backend",
                             "distributed_executor_backend")}
        return {
            "url": self.url, "version": self.version, "system_fingerprint": self.fingerprint,
            "models": self.models, "per_request_spec_decode_metrics": self.per_request_metrics,
            "num_speculative_tokens": self.reported().get("num_speculative_tokens", (None,))[0],
            "cache_config": {k: v for k, v in self.cache_config.items()
                             if k in ("block_size", "cache_dtype", "gpu_memory_utilization", "num_gpu_blocks",
                                      "kv_cache_memory_bytes", "enable_prefix_caching")},
            "server_info": self.server_info is not None,
            **({"parallel_config": parallel} if parallel else {}),
            **({"speculative_config": {k: spec.get(k) for k in ("method", "model", "num_speculative_tokens",
                                                                 "draft_tensor_parallel_size")}} if spec else {}),
            **({"model_config": {k: model.get(k) for k in ("model", "tokenizer", "dtype", "max_model_len", "seed",
                                                            "enforce_eager")}} if model else {}),
            **({"compilation_config": {k: compilation.get(k) for k in ("cudagraph_mode", "cudagraph_capture_sizes")}}
               if compilation else {}),
            **({"device": self.config("device_config").get("device")} if self.config("device_config") else {}),
        }

    def host(self) -> HostFacts | None:
        """The server's machine, from /server_info's system_env (None where the server does not say)."""
        env = (self.server_info or {}).get("system_env")
        if not isinstance(env, dict):
            return None
        cpu = re.search(r"^Model name:\s*(.+)$", str(env.get("cpu_info") or ""), re.M)
        gpus = [g.split(":", 1)[-1].strip() for g in str(env.get("nvidia_gpu_models") or "").splitlines() if g.strip()]
        return HostFacts(hostname=None, platform=env.get("python_platform") or env.get("os"),
                         python=str(env.get("python_version") or "").split(" ")[0] or None,
                         torch=env.get("torch_version"), cuda=env.get("cuda_compiled_version"), gpus=gpus,
                         gpu_driver=env.get("nvidia_driver_version"), cpu_model=cpu.group(1).strip() if cpu else None,
                         source="/server_info system_env")


def _fingerprint_tp(fingerprint: str | None) -> int | None:
    m = _FINGERPRINT.match(fingerprint or "")
    tp = re.search(r"-tp(\d+)", m.group("parallel")) if m else None
    return int(tp.group(1)) if tp else None


def _optional(client: VllmClient, path: str) -> dict | None:
    """A JSON endpoint that a server may not have (404, 405) or may guard; None then."""
    try:
        return client.get_json(path)
    except ClientError as exc:
        if exc.status is not None and exc.status not in (401, 403):
            return None
        raise


def read_facts(client: VllmClient) -> ServerFacts:
    """Everything the server's endpoints say about it (the probe reply's facts are added by the caller); ClientError
    where a required endpoint fails (an unreachable server, a refused API key)."""
    facts = ServerFacts(url=client.base_url)
    models = client.get_json("/v1/models")  # guarded by --api-key: a wrong key fails here, before anything runs
    listed = models.get("data")
    facts.models = [{k: m.get(k) for k in ("id", "root", "max_model_len")} for m in listed
                    if isinstance(m, dict)] if isinstance(listed, list) else []
    version = _optional(client, "/version")
    facts.version = str(version["version"]) if version and "version" in version else None
    facts.server_info = _optional(client, "/server_info?config_format=json")
    try:
        for name, labels, _ in parse_samples(client.metrics_text()):
            if name == CACHE_INFO and not facts.cache_config:
                facts.cache_config = {k: v for k, v in labels.items() if k != "engine"}
            elif name == ACCEPTED_PER_POS:
                facts.metrics_k = max(facts.metrics_k or 0, int(labels.get("position", -1)) + 1)
    except ValueError as exc:  # not Prometheus text, or a position that is no number
        raise ClientError(f"/metrics: {one_line(str(exc))}", reached=True) from None
    return facts
