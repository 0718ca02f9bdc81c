"""AttachEngine: one arm replayed through a vLLM server that qual did not start (docs/vllm.md, "Attach mode").

The deployment owns the server: qual cannot choose its flags, see its start-up log or read its source. So the
arm's DCP, TP, dtype and K are the run's expectations, checked against what the server reports where it reports
them (`verified` in the arm's facts says which were); graph capture is not observed; draft-KV replication and the
k_norm CPU bug are unknown. Acceptance per request comes from the reply's per-request spec-decode metrics, or,
where the server sends none, from /metrics counter diffs, which are only one request's when nothing else runs on
the server (--exclusive) and requests go one at a time.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import CancelledError, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

from pydantic import Field

from qual import shown
from qual.engines.base import Engine, refuse_numerics
from qual.engines.vllm.client import ClientError, Completion, VllmClient
from qual.engines.vllm.facts import ServerFacts, read_facts
from qual.engines.vllm.metrics import counts_from_reply
from qual.engines.vllm.transport import REDIRECTS, one_line
from qual.errors import EngineError, QualError
from qual.files import open_append
from qual.inventory import too_old
from qual.options import NOT_OBSERVED, REVISION_KEYS
from qual.records import (GRAPH_NOT_OBSERVED, AcceptanceCounts, ArmConfig, ArmRunInfo, EngineBuild, EngineRequest,
                          GraphCapture, OnResult, RequestResult)
from qual.redact import check_api_key, redact_url
from qual.validation import Section, parse_section

PER_REQUEST, METRICS_DIFF = "per_request_metrics", "metrics_diff"  # RequestResult.acceptance_source
COUNTER_SETTLE_S = 5.0  # /metrics is updated just after the reply is sent
# Knobs an attached arm cannot apply and cannot check. Its dcp, tp, dtype are expectations, checked where reported.
REFUSED = {"draft_kv": "--draft-kv: an attached server's build decides draft-KV replication, and its API does not say",
           "device": "--device: an attached server runs where its deployment put it"}
MAX_DEADLINE_S = 86400.0  # a deadline setting's upper bound (a day)


class AttachOptions(Section):
    """A profile's `attach:` section: how qual talks to servers it did not start."""

    served_model_name: str | None = None
    """The model name to ask the servers for (default: the one model a server lists)"""
    request_timeout_s: float = Field(600.0, gt=0, le=MAX_DEADLINE_S)
    """Each completion's deadline, from the connect to the reply's last byte (a server sending a byte a second meets it
    too), in seconds; the arm records it"""
    connect_timeout_s: float = Field(10.0, gt=0, le=MAX_DEADLINE_S)
    """Each call's deadline while attaching (/v1/models, /version, /server_info, /metrics, the probe reply, /tokenize)
    and each TCP handshake of the run's calls, in seconds: a silent server fails after this, not after the request
    deadline"""


@dataclass(frozen=True)
class ServerSpec:
    """The run's side of one attached arm (ArmConfig.extra["server"], set by the plan from the CLI)."""

    url: str
    arm: str  # control | candidate: named in every message
    api_key_env: str | None = None  # the variable holding the key, never the key (result.json is shared)
    exclusive: bool = False  # the user asserts nothing else uses the server during the run
    max_concurrency: int = 1

    @classmethod
    def of(cls, arm: ArmConfig) -> "ServerSpec":
        server = arm.extra.get("server")
        if not isinstance(server, dict) or not server.get("url"):
            raise QualError("the attach engine needs --control-url and --candidate-url (the servers to attach to)")
        return cls(**{k: server[k] for k in cls.__dataclass_fields__ if k in server})

    @property
    def shown_url(self) -> str:
        return redact_url(self.url)  # the plan refuses userinfo; nothing shows one all the same

    @property
    def who(self) -> str:
        return f"{self.arm} server {self.shown_url}"

    def api_key(self) -> str | None:
        if self.api_key_env is None:
            return None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise QualError(f"--api-key-env {self.api_key_env}: the variable is not set (it holds the {self.arm} "
                            "server's API key)")
        check_api_key(self.api_key_env)  # as the plan did: it may have changed since (a resumed run)
        return key


OBSERVED = ("server_version",)  # kept beside the settings in ArmConfig.extra["attach"] by preflight: facts, not options


def _options(arm: ArmConfig) -> AttachOptions:
    return AttachOptions(**{k: v for k, v in (arm.extra.get("attach") or {}).items() if k not in OBSERVED})


class AttachEngine(Engine):
    """Replays an arm through a running OpenAI-compatible vLLM server (its URL from --control-url/--candidate-url)."""

    name = "attach"
    options_model = AttachOptions
    honours = frozenset({"temperature", "seed"})  # sent with every request
    attaches = True

    @classmethod
    def parse_options(cls, section: dict, where: str) -> dict:
        return parse_section(AttachOptions, section, where, "attach").model_dump(exclude_defaults=True)

    def missing(self, arms: list[ArmConfig], gpu_memory_gib: float | None = None) -> list[str]:
        """Nothing of this machine: the servers run where they run (preflight asks them)."""
        return []

    def dry_check(self, arm: ArmConfig, requested: frozenset[str]) -> ArmConfig:
        """The knobs and keys an attached server cannot take, refused without asking it."""
        for knob in sorted(requested & set(REFUSED)):
            raise QualError(REFUSED[knob])
        refuse_numerics(arm, self.name)
        for key in REVISION_KEYS:
            if arm.extra.get(key):
                raise QualError(f"{key}: an attached server loaded its checkpoints itself; qual cannot apply a hub "
                                "revision to it (remove the key from the profile)")
        return arm

    def preflight(self, arm: ArmConfig, requested: frozenset[str]) -> ArmConfig:
        self.dry_check(arm, requested)
        spec = ServerSpec.of(arm)
        facts = self._attach(arm, spec, _options(arm))
        device = facts.config("device_config").get("device") or NOT_OBSERVED  # where the deployment put it
        # Every setting as it applies, defaults included: the deadlines a run ran under are part of its record.
        settings = {**_options(arm).model_dump(), "served_model_name": self._model(arm, spec, facts),
                    "server_version": facts.version}
        return replace(arm, draft_kv=NOT_OBSERVED, device=one_line(str(device)), extra={**arm.extra, "attach": settings})

    def version(self, arm: ArmConfig) -> str | None:
        attached = arm.extra.get("attach") or {}
        return _version_label(attached["server_version"]) if "server_version" in attached else None  # after preflight

    def describe(self, arm: ArmConfig) -> str:
        spec = ServerSpec.of(arm)
        key = f", API key from ${spec.api_key_env}" if spec.api_key_env else ""
        return (f"attach to {spec.shown_url} (expects DCP {arm.dcp}, TP {arm.tp}, {arm.dtype}, K {arm.num_speculative_tokens}"
                f"{key}; max concurrency {spec.max_concurrency}{', exclusive' if spec.exclusive else ''})")

    def tokenize(self, arm: ArmConfig, prompts: list[str]) -> list[list[int]]:
        spec, options = ServerSpec.of(arm), _options(arm)
        client = self._client(arm, spec, options, attaching=True)
        try:
            return [client.tokenize(text) for text in prompts]
        except ClientError as exc:
            raise self._unreachable(spec, exc, "/tokenize") from exc

    # -- attaching: who is there, and is it what the run expects ---------------------------------

    def _client(self, arm: ArmConfig, spec: ServerSpec, options: AttachOptions, attaching: bool) -> VllmClient:
        """A client whose every call has attach.connect_timeout_s while attaching, attach.request_timeout_s in a run."""
        model = options.served_model_name or arm.model
        setting = "connect_timeout_s" if attaching else "request_timeout_s"
        return VllmClient(spec.url, model, timeout_s=getattr(options, setting), api_key=spec.api_key(),
                          connect_timeout_s=options.connect_timeout_s, timeout_name=f"the profile's attach.{setting}")

    def _attach(self, arm: ArmConfig, spec: ServerSpec, options: AttachOptions) -> ServerFacts:
        """The server's facts, refused (QualError, exit 2) where they contradict the run; unreachable: EngineError."""
        client = self._client(arm, spec, options, attaching=True)
        try:
            facts = read_facts(client)
            client.model = self._model(arm, spec, facts)
            probe = client.complete([0], 1, 0.0, 0)  # one token, no draft step: shows what replies carry
        except ClientError as exc:
            raise self._unreachable(spec, exc, "attaching") from exc
        facts.fingerprint, facts.probe_spec_decode = probe.fingerprint, probe.spec_decode
        if old := too_old(facts.version):
            raise QualError(f"{spec.who} reports vLLM {one_line(facts.version)}, {old}")
        if arm.draft_path is not None and not facts.per_request_metrics:
            why = (f"{spec.who} sends no per-request spec-decode metrics (start it with "
                   "--per-request-spec-decode-metrics detailed)")
            if not spec.exclusive:
                raise QualError(f"{why}; /metrics counters are only one request's where nothing else uses the server: "
                                "pass --exclusive to assert that (at --max-concurrency 1)")
            if spec.max_concurrency != 1:
                raise QualError(f"{why}; with --exclusive acceptance comes from /metrics counter diffs, which need "
                                f"requests one at a time (--max-concurrency 1, got {spec.max_concurrency})")
            if facts.metrics_k is None:
                raise QualError(f"{why}, and its /metrics has no spec-decode series: acceptance cannot be measured")
        for knob, (expected, reported, source) in _verified(arm, facts).items():
            if reported is not None and reported != expected:
                raise QualError(f"{spec.who} reports {knob} {one_line(str(reported))} ({source}); the run expects "
                                f"{expected}")
        return facts

    @staticmethod
    def _model(arm: ArmConfig, spec: ServerSpec, facts: ServerFacts) -> str:
        names = [m["id"] for m in facts.models if m.get("id")]
        wanted = (arm.extra.get("attach") or {}).get("served_model_name")
        if wanted is not None:
            if wanted not in names:
                raise QualError(f"{spec.who} does not serve {wanted!r} (attach.served_model_name); it serves "
                                f"{one_line(', '.join(map(repr, names))) or 'nothing'}")
            return wanted
        if len(names) != 1:
            raise QualError(f"{spec.who} serves {len(names)} models ({one_line(', '.join(map(repr, names)))}): name one "
                            "with the profile's attach.served_model_name")
        return names[0]

    @staticmethod
    def _unreachable(spec: ServerSpec, exc: ClientError, during: str) -> Exception:
        """A call that failed before the run: the user's to fix (a refused key, a URL that redirects elsewhere: exit 2)
        or the server's (exit 3)."""
        if exc.status in (401, 403):
            how = f"the API key from ${spec.api_key_env}" if spec.api_key_env else "no API key (pass --api-key-env NAME)"
            return QualError(f"{spec.who} refused {how} (HTTP {exc.status})")
        if exc.status in REDIRECTS:
            return QualError(f"{spec.who}: {exc}")
        return EngineError(f"{spec.who} {'failed' if exc.reached else 'is unreachable'} ({during}): {exc}")

    # -- running an arm ---------------------------------------------------------------------------

    def run(self, arm: ArmConfig, requests: list[EngineRequest], on_result: OnResult, run_dir: Path,
            name: str) -> ArmRunInfo:
        spec, options = ServerSpec.of(arm), _options(arm)
        facts = self._attach(arm, spec, options)  # again: the server at the URL may have changed since preflight
        client = self._client(arm, spec, options, attaching=False)
        log_path = Path(run_dir) / f"{name}.attach.log"
        with open_append(log_path) as log:  # a link planted at the log is refused
            _log(log, f"attached to {spec.shown_url}: vLLM {facts.version}, model {client.model!r}, fingerprint "
                      f"{facts.fingerprint}, per-request metrics {'yes' if facts.per_request_metrics else 'no'}, "
                      f"max concurrency {spec.max_concurrency}{', exclusive' if spec.exclusive else ''}")
            start = time.monotonic()
            sources, output_tokens = _Replay(arm, spec, client, log, log_path, run_dir).run(requests, on_result)
            wall = time.monotonic() - start
        return ArmRunInfo(engine_version=_version_label(facts.version), graph_capture=_graph_capture(facts),
                          wall_seconds=wall, generate_seconds=wall, output_tokens=output_tokens,
                          log_path=str(log_path), build=_build(facts), extra=_facts(arm, spec, facts, sources))


class _Replay:
    """Sends the requests (up to max_concurrency at once) and turns each reply into a RequestResult."""

    def __init__(self, arm: ArmConfig, spec: ServerSpec, client: VllmClient, log: TextIO, log_path: Path, run_dir):
        self.arm, self.spec, self.client, self.log, self.log_path, self.run_dir = arm, spec, client, log, log_path, run_dir
        self.k = arm.num_speculative_tokens if arm.draft_path else 0
        self.sources = {PER_REQUEST: 0, METRICS_DIFF: 0}
        self.finished: list[AcceptanceCounts] = []
        self.output_tokens = 0

    def run(self, requests: list[EngineRequest], on_result: OnResult) -> tuple[dict[str, int], int]:
        baseline = self._counters("before the first request") if self.spec.exclusive else None
        if self.spec.max_concurrency == 1:
            last = baseline
            for req in requests:  # one at a time: the counters between two replies are one request's
                try:
                    sent = self._send(req)
                except ClientError as exc:
                    raise self._went_away(req, exc) from exc
                last = self._finish(req, *sent, on_result, last)
        else:
            self._concurrently(requests, on_result)
        if baseline is not None:
            self._check_totals(baseline)
        return self.sources, self.output_tokens

    def _send(self, req: EngineRequest) -> tuple[Completion, float]:
        """The reply, and the seconds it took (for the log)."""
        t0 = time.monotonic()
        completion = self.client.complete(list(req.prompt_token_ids), req.max_tokens, self.arm.sampling.temperature,
                                          self.arm.sampling.seed)
        return completion, time.monotonic() - t0

    def _concurrently(self, requests: list[EngineRequest], on_result: OnResult) -> None:
        pool = ThreadPoolExecutor(self.spec.max_concurrency, thread_name_prefix=f"qual-{self.spec.arm}")
        failure = None
        try:
            futures = {pool.submit(self._send, req): req for req in requests}
            for future in as_completed(futures):  # results go to the journal here, in this thread, as they finish
                req = futures[future]
                try:
                    sent = future.result()
                except CancelledError:
                    continue
                except ClientError as exc:
                    if failure is None:
                        failure = (req, exc)
                        for other in futures:
                            other.cancel()  # in-flight requests still finish and are kept
                    continue
                self._finish(req, *sent, on_result, None)
        finally:
            pool.shutdown(wait=failure is not None, cancel_futures=True)
        if failure is not None:
            raise self._went_away(*failure)

    def _finish(self, req: EngineRequest, completion: Completion, seconds: float, on_result: OnResult,
                last: AcceptanceCounts | None) -> AcceptanceCounts | None:
        """This request's result (journaled by on_result); the /metrics counters after it where they are read."""
        settle = False  # the reply's own counts, the counters read after it is journaled: a server gone then keeps it
        if completion.spec_decode is not None:
            counts, source = self._reply_counts(req, completion.spec_decode), PER_REQUEST
            settle = last is not None
        elif self.k == 0:
            counts, source = AcceptanceCounts(), None
        elif last is not None:  # --exclusive at concurrency 1: the counters moved by this request alone
            last, counts = self._diff(req, last)
            source = METRICS_DIFF
        else:
            raise EngineError(f"{self.spec.who}: the reply to request {req.id} carries no per-request spec-decode "
                              "metrics (was the server restarted with other flags?); without them acceptance needs "
                              "--exclusive at --max-concurrency 1", self.log_path)
        if source:
            self.sources[source] += 1
        self.finished.append(counts)
        self.output_tokens += len(completion.output_token_ids)
        _log(self.log, f"request {req.id}: {len(completion.output_token_ids)} tokens ({completion.finish_reason}), "
                       f"{counts.drafts} drafts, {counts.accepted_tokens}/{counts.draft_tokens} accepted "
                       f"[{source or 'no drafter'}], {seconds:.2f} s")
        on_result(RequestResult(
            id=req.id, category=req.category, prompt_token_ids=list(completion.prompt_token_ids),
            output_token_ids=list(completion.output_token_ids), **counts.result_fields(),
            finish_reason=completion.finish_reason,
            acceptance_source=source,
            latency=completion.latency,
        ))
        return self._settled(req, last, counts) if settle else last

    def _reply_counts(self, req: EngineRequest, metrics) -> AcceptanceCounts:
        try:
            return counts_from_reply(metrics, self.k)
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise EngineError(f"{self.spec.who}: the reply to request {req.id} carries spec-decode metrics qual cannot "
                              f"read ({one_line(repr(metrics))}): `{shown.command(['qual', 'run', '--resume', self.run_dir])}` "
                              "finishes the run once the server answers as vLLM does", self.log_path) from exc

    def _counters(self, when: str, req: EngineRequest | None = None) -> AcceptanceCounts:
        """The server's counters now; read after `req`, a server gone meanwhile is one that went away (resumable)."""
        try:
            return self.client.spec_counters()
        except (ClientError, ValueError) as exc:
            if isinstance(exc, ClientError) and req is not None and not self.client.healthy():
                raise self._went_away(req, exc, "after") from exc
            raise EngineError(f"{self.spec.who}: /metrics unreadable {when} ({exc})", self.log_path) from exc

    def _diff(self, req: EngineRequest, last: AcceptanceCounts) -> tuple[AcceptanceCounts, AcceptanceCounts]:
        """The counters once they stop moving (two equal reads), and what moved since `last`."""
        now = self._counters("after a request", req)
        deadline = time.monotonic() + COUNTER_SETTLE_S
        while time.monotonic() < deadline:
            time.sleep(0.05)
            again = self._counters("after a request", req)
            if again == now:
                break
            now = again
        return now, (now - last).padded(self.k)

    def _settled(self, req: EngineRequest, last: AcceptanceCounts, expected: AcceptanceCounts) -> AcceptanceCounts:
        """The counters once they show this request (exclusive runs check the totals at the end)."""
        deadline = time.monotonic() + COUNTER_SETTLE_S
        while True:
            now = self._counters("after a request", req)
            if (now - last).padded(self.k) == expected or time.monotonic() >= deadline:
                return now
            time.sleep(0.05)

    def _check_totals(self, baseline: AcceptanceCounts) -> None:
        """On a server the run had to itself, the requests' numbers add up to what its counters moved by."""
        k = self.k
        ours = sum(self.finished, AcceptanceCounts()).padded(k)
        deadline = time.monotonic() + COUNTER_SETTLE_S
        while True:
            theirs = (self._counters("after the last request") - baseline).padded(k)
            if theirs == ours or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        if theirs != ours:
            raise EngineError(f"{self.spec.who}: per-request acceptance does not add up to the server's /metrics "
                              f"counters (requests sum to {ours}, counters moved by {theirs}): was the server really "
                              "used by this run alone (--exclusive)?", self.log_path)

    def _went_away(self, req: EngineRequest, exc: ClientError, when: str = "during") -> EngineError:
        gone = not self.client.healthy()
        what = "went away" if gone else "failed"
        kept = len(self.finished)
        _log(self.log, f"request {req.id}: {exc}; server {'unreachable' if gone else 'still answers /health'}")
        return EngineError(f"{self.spec.who} {what} {when} request {req.id} ({exc}); {kept} finished request"
                           f"{'' if kept == 1 else 's'} of this arm kept: `{shown.command(['qual', 'run', '--resume', self.run_dir])}` "
                           "finishes the run once the server answers", self.log_path)


def _version_label(version: str | None) -> str:
    return f"vllm {version or 'unknown version'} (attached)"


def _log(log: TextIO, line: str) -> None:
    log.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")
    log.flush()


def _verified(arm: ArmConfig, facts: ServerFacts) -> dict[str, tuple[object, object, str | None]]:
    """knob -> (expected, reported or None, where the server said so)."""
    reported = facts.reported()
    expected = {"dcp": arm.dcp, "tp": arm.tp, "dtype": arm.dtype, "interleave": arm.interleave}
    if arm.draft_path is not None:
        expected |= {"num_speculative_tokens": arm.num_speculative_tokens, "speculative_method": "dflash"}
    return {knob: (want, *reported.get(knob, (None, None))) for knob, want in expected.items()}


def _graph_capture(facts: ServerFacts) -> GraphCapture:
    compilation, model = facts.config("compilation_config"), facts.config("model_config")
    said = []
    if model.get("enforce_eager") is not None:
        said.append(f"enforce_eager {model['enforce_eager']}")
    if compilation:
        said.append(f"cudagraph_mode {compilation.get('cudagraph_mode')}, capture sizes "
                    f"{compilation.get('cudagraph_capture_sizes')}")
    configured = f"; the server's configuration (/server_info): {', '.join(said)}" if said else ""
    return GraphCapture(status=GRAPH_NOT_OBSERVED,
                        detail=f"attached server: its start-up, where vLLM captures graphs, was not observed{configured}")


def _build(facts: ServerFacts) -> EngineBuild:
    summary = facts.summary()
    return EngineBuild(name="vllm", version=facts.version, commit=None, host=facts.host(),
                       runtime_config={k: summary[k] for k in ("parallel_config", "speculative_config", "model_config",
                                                               "compilation_config") if k in summary} or None,
                       reported=summary,
                       source=f"attached server {facts.url}: /version, /v1/models, /metrics"
                              + (", /server_info" if facts.server_info is not None else "") + ", a probe reply")


def _facts(arm: ArmConfig, spec: ServerSpec, facts: ServerFacts, sources: dict[str, int]) -> dict:
    if facts.per_request_metrics:
        policy = "per-request metrics (the server's replies)"
    else:
        policy = "/metrics counter diffs at concurrency 1 (--exclusive)"
    return {
        "server_url": spec.shown_url,
        "server": facts.summary(),
        "server_command": None,  # qual did not start it: the deployment's command is not visible
        "acceptance_source": policy,
        "acceptance_sources": sources,  # requests of this piece by where their acceptance came from
        "max_concurrency": spec.max_concurrency,
        "exclusive": spec.exclusive,
        "verified": {knob: {"expected": e, "reported": r, "source": s} for knob, (e, r, s) in _verified(arm, facts).items()},
        # Facts of the build's source, which a server's API does not expose: `qual doctor` on its machine tells.
        "draft_kv_replicated_in_build": NOT_OBSERVED,
        **({"dflash_context_knorm_per_layer_in_build": NOT_OBSERVED} if arm.draft_path else {}),
    }
