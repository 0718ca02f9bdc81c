"""Client for the server's OpenAI-compatible API and /metrics (stdlib only: qual/engines/vllm/transport.py).

Every call has a deadline, a reply cap by endpoint and no redirect to another origin (transport.py says why)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from qual.engines.vllm.metrics import parse_spec_counters
from qual.engines.vllm.transport import MiB, ClientError, fetch, fetch_lines, one_line
from qual.errors import QualError
from qual.records import AcceptanceCounts, RequestLatency, measured_latency
from qual.userfiles import load_reply

__all__ = ["ClientError", "Completion", "VllmClient", "answers_health", "REPLY_CAPS"]

# The largest reply read from each endpoint; generous for completions (the prompt's ids come back with the output's)
# and /tokenize, tight where a reply is a few KiB. A larger reply is a ClientError naming the URL.
REPLY_CAPS = {"/v1/completions": 64 * MiB, "/tokenize": 64 * MiB, "/metrics": 16 * MiB}
OTHER_REPLY_CAP = 4 * MiB  # /v1/models, /version, /server_info, /health
CONNECT_TIMEOUT_S = 10.0  # each TCP (and TLS) handshake, unless the caller says otherwise


@dataclass
class Completion:
    """One finished completion: token ids in and out, and the server's own per-request metrics if any."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str
    spec_decode: dict | None  # the response's metrics.speculative_decoding, when the server sends it
    fingerprint: str | None = None  # the response's system_fingerprint (vLLM: version, parallel sizes, config hash)
    latency: RequestLatency | None = None  # when its tokens came (streamed: each step's; whole: the end only)


class VllmClient:
    """Talks to one server at base_url, with its API key (sent on every request).

    timeout_s is each call's deadline, from its connect to its reply's last byte (timeout_name: the setting that
    chose it, named where it passes); connect_timeout_s bounds each handshake."""

    def __init__(self, base_url: str, model: str, timeout_s: float = 600.0, api_key: str | None = None,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S, timeout_name: str = "the client's deadline"):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.timeout_name = timeout_name
        self._api_key = api_key  # sent as a bearer token (vLLM's --api-key guards /v1/*)

    def __repr__(self) -> str:  # never the key
        return f"VllmClient({self.base_url!r}, {self.model!r})"

    def _headers(self, json_body: bool) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        if json_body:
            headers["Content-Type"] = "application/json"
        return headers

    def _request(self, path: str, payload: dict | None = None) -> bytes:
        data = json.dumps(payload).encode() if payload is not None else None
        headers = self._headers(data is not None)
        return fetch(self.base_url + path, data=data, headers=headers,
                     max_bytes=REPLY_CAPS.get(urlsplit(path).path, OTHER_REPLY_CAP), deadline_s=self.timeout_s,
                     connect_s=self.connect_timeout_s, deadline_name=self.timeout_name)

    def get_json(self, path: str, payload: dict | None = None) -> dict:
        """A JSON object from GET path (POST where payload is given)."""
        raw = self._request(path, payload)
        try:
            body = load_reply(raw, path)  # bounded: deep nesting, a repeated key, a huge number are refused
        except QualError as exc:
            raise ClientError(f"{path}: not JSON qual reads ({exc}): {raw[:200]!r}", reached=True) from None
        if not isinstance(body, dict):
            raise ClientError(f"{path}: expected a JSON object, got {raw[:200]!r}", reached=True)
        return body

    def healthy(self, timeout_s: float = 5.0) -> bool:
        """Whether /health answers 200 now."""
        return answers_health(self.base_url, timeout_s)

    def tokenize(self, text: str) -> list[int]:
        """The server's own tokenization of a prompt (/tokenize, no special tokens added, as qual tokenizes)."""
        body = self.get_json("/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": False})
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ClientError(f"/tokenize: no token list in the reply: {str(body)[:200]}", reached=True)
        return tokens

    def spec_counters(self) -> AcceptanceCounts:
        """The server's cumulative spec-decode counters."""
        return parse_spec_counters(self.metrics_text())

    def metrics_text(self) -> str:
        return self._request("/metrics").decode(errors="replace")

    def complete(
        self, prompt_token_ids: list[int], max_tokens: int, temperature: float, seed: int
    ) -> Completion:
        """One /v1/completions call with token ids in; token ids out via `return_token_ids`, streamed so that each
        step's tokens are timed as they arrive (the usage event at the end carries the per-request metrics). A server
        that answers whole instead is read as such, timed end to end only."""
        payload = {
            "model": self.model,
            "prompt": list(prompt_token_ids),
            "max_tokens": max_tokens,
            "temperature": temperature,
            "seed": seed,
            "return_token_ids": True,
            "skip_special_tokens": False,
            # Generate exactly max_tokens where the caller asked for it: both arms must see equal work.
            "ignore_eos": False,
            "stream": True,
            "stream_options": {"include_usage": True},  # vLLM sends metrics.speculative_decoding with the usage
        }
        reply = CompletionStream()
        sent = time.perf_counter()
        fetch_lines(self.base_url + "/v1/completions", reply.line, data=json.dumps(payload).encode(),
                    headers=self._headers(json_body=True), max_bytes=REPLY_CAPS["/v1/completions"],
                    deadline_s=self.timeout_s, connect_s=self.connect_timeout_s, deadline_name=self.timeout_name)
        return reply.completion(list(prompt_token_ids), sent)


def _object(value) -> dict | None:
    return value if isinstance(value, dict) else None  # what is not an object carries no metrics


def _ids(value) -> bool:
    return isinstance(value, list) and all(type(t) is int for t in value)


class CompletionStream:
    """A /v1/completions reply read line by line: server-sent events (`data: {...}`, then `data: [DONE]`), each
    step's token ids timed as they arrive; or, where the server answered whole, its JSON body."""

    def __init__(self):
        self.streamed: bool | None = None  # decided by the reply's first line
        self.body: list[bytes] = []  # a whole reply's lines
        self.output: list[int] = []
        self.step_times: list[float] = []  # when each event with tokens arrived
        self.prompt_ids: list[int] | None = None
        self.finish_reason: str | None = None
        self.metrics: dict | None = None
        self.fingerprint: str | None = None
        self.saw_token_ids = False
        self.last = 0.0  # when the reply's last line arrived

    def line(self, raw: bytes, now: float) -> None:
        """One line of the reply, read at `now` (perf_counter)."""
        self.last = now
        if self.streamed is None and raw.strip():  # a JSON document, or events (`data:`, `:` comments, `event:`...)
            self.streamed = raw.lstrip()[:1] not in (b"{", b"[")
        if not self.streamed:
            self.body.append(raw)
            return
        if not raw.startswith(b"data:"):
            return  # the blank line between events, a comment, an event's other fields
        data = raw[5:].strip()
        if data == b"[DONE]":
            return
        try:
            event = load_reply(data, "/v1/completions event")
        except QualError as exc:
            raise ClientError(f"unexpected /v1/completions event ({exc}): {data[:300]!r}", reached=True) from None
        if not isinstance(event, dict):
            raise ClientError(f"unexpected /v1/completions event: {data[:300]!r}", reached=True)
        if "error" in event:  # vLLM reports a failure mid-stream as an event
            error = event["error"]
            message = error.get("message") if isinstance(error, dict) else error
            raise ClientError(f"/v1/completions failed mid-stream: {one_line(str(message))}", reached=True)
        self._event(event, now, data)

    def _event(self, event: dict, now: float, data: bytes) -> None:
        choices = event.get("choices") or []
        if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
            raise ClientError(f"unexpected /v1/completions event: {data[:300]!r}", reached=True)
        for choice in choices[:1]:
            if "token_ids" in choice:
                self.saw_token_ids = True
                ids = choice["token_ids"] or []
                if not _ids(ids):
                    raise ClientError(f"unexpected /v1/completions event (token ids that are not integers): "
                                      f"{data[:300]!r}", reached=True)
                if ids:
                    self.output += ids
                    self.step_times.append(now)
            if choice.get("prompt_token_ids") is not None:
                self.prompt_ids = choice["prompt_token_ids"]
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        metrics = event.get("metrics")
        if isinstance(metrics, dict) and "speculative_decoding" in metrics:
            self.metrics = _object(metrics["speculative_decoding"])
        self.fingerprint = event.get("system_fingerprint") or self.fingerprint

    def completion(self, prompt_token_ids: list[int], sent: float) -> Completion:
        """The finished reply; `sent`: when the request went out (perf_counter), its latency's origin."""
        if not self.streamed:
            return self._whole(prompt_token_ids, sent)
        if not self.saw_token_ids:
            raise ClientError("the server returned no token_ids (does it support return_token_ids?)", reached=True)
        prompt_ids = self.prompt_ids if self.prompt_ids is not None else prompt_token_ids
        if not _ids(prompt_ids):
            raise ClientError("unexpected /v1/completions reply (prompt token ids that are not integers)", reached=True)
        return Completion(prompt_token_ids=list(prompt_ids), output_token_ids=self.output,
                          finish_reason=self.finish_reason or "length", spec_decode=self.metrics,
                          fingerprint=self.fingerprint,
                          latency=measured_latency(sent, self.step_times, self.last, len(self.output)))

    def _whole(self, prompt_token_ids: list[int], sent: float) -> Completion:
        raw = b"".join(self.body)
        try:
            body = load_reply(raw, "/v1/completions")
            choice = body["choices"][0]
            output = choice["token_ids"]
        except (QualError, KeyError, IndexError, TypeError) as exc:
            raise ClientError(f"unexpected /v1/completions reply: {raw[:300]!r}", reached=True) from exc
        if output is None:
            raise ClientError("the server returned no token_ids (does it support return_token_ids?)", reached=True)
        prompt_ids = choice.get("prompt_token_ids") or body.get("prompt_token_ids") or list(prompt_token_ids)
        if not all(_ids(ids) for ids in (output, prompt_ids)):
            raise ClientError(f"unexpected /v1/completions reply (token ids that are not integers): {raw[:300]!r}",
                              reached=True)
        metrics = body.get("metrics") or choice.get("metrics") or {}
        return Completion(
            prompt_token_ids=list(prompt_ids),
            output_token_ids=list(output),
            finish_reason=choice.get("finish_reason") or "length",
            spec_decode=_object(metrics.get("speculative_decoding")) if isinstance(metrics, dict) else None,
            fingerprint=body.get("system_fingerprint"),
            latency=measured_latency(sent, [], self.last or sent, len(output)),
        )


def answers_health(base_url: str, timeout_s: float) -> bool:
    """Whether base_url's /health answers 200 within timeout_s (a launched server's or an attached one's)."""
    try:
        fetch(base_url.rstrip("/") + "/health", max_bytes=OTHER_REPLY_CAP, deadline_s=timeout_s,
              connect_s=min(timeout_s, CONNECT_TIMEOUT_S), deadline_name="the /health check's")
        return True
    except (ClientError, ValueError):
        return False
