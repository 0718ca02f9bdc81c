"""Minimal client for the server's OpenAI-compatible API and /metrics (stdlib only)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass

from qual.engines.vllm.metrics import parse_spec_counters
from qual.records import AcceptanceCounts


class ClientError(Exception):
    """The server refused or failed a request (HTTP error, bad reply, connection lost)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status  # the HTTP status where the server answered; None where it did not


@dataclass
class Completion:
    """One finished completion: token ids in and out, and the server's own per-request metrics if any."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str
    spec_decode: dict | None  # the response's metrics.speculative_decoding, when the server sends it
    fingerprint: str | None = None  # the response's system_fingerprint (vLLM: version, parallel sizes, config hash)


class VllmClient:
    """Talks to one server at base_url, with its API key (sent on every request)."""

    def __init__(self, base_url: str, model: str, timeout_s: float = 600.0, api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout_s = timeout_s
        self._api_key = api_key  # sent as a bearer token (vLLM's --api-key guards /v1/*)

    def __repr__(self) -> str:  # never the key
        return f"VllmClient({self.base_url!r}, {self.model!r})"

    def _request(self, path: str, payload: dict | None = None) -> bytes:
        data = json.dumps(payload).encode() if payload is not None else None
        req = urllib.request.Request(self.base_url + path, data=data)
        if self._api_key:
            req.add_header("Authorization", f"Bearer {self._api_key}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return resp.read()
        except urllib.error.HTTPError as exc:
            body = exc.read().decode(errors="replace")[:500]
            raise ClientError(f"HTTP {exc.code} from {path}: {body}", exc.code) from exc
        except (urllib.error.URLError, OSError) as exc:
            raise ClientError(f"{path}: {exc}") from exc

    def get_json(self, path: str, payload: dict | None = None) -> dict:
        """A JSON object from GET path (POST where payload is given)."""
        raw = self._request(path, payload)
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise ClientError(f"{path}: not JSON: {raw[:200]!r}") from exc
        if not isinstance(body, dict):
            raise ClientError(f"{path}: expected a JSON object, got {raw[:200]!r}")
        return body

    def healthy(self, timeout_s: float = 5.0) -> bool:
        """Whether /health answers 200 now."""
        return answers_health(self.base_url, timeout_s)

    def tokenize(self, text: str) -> list[int]:
        """The server's own tokenization of a prompt (/tokenize, no special tokens added, as qual tokenizes)."""
        body = self.get_json("/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": False})
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ClientError(f"/tokenize: no token list in the reply: {str(body)[:200]}")
        return tokens

    def spec_counters(self) -> AcceptanceCounts:
        """The server's cumulative spec-decode counters."""
        return parse_spec_counters(self.metrics_text())

    def metrics_text(self) -> str:
        return self._request("/metrics").decode()

    def complete(
        self, prompt_token_ids: list[int], max_tokens: int, temperature: float, seed: int
    ) -> Completion:
        """One /v1/completions call with token ids in; token ids out via `return_token_ids`."""
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
        }
        raw = self._request("/v1/completions", payload)
        try:
            body = json.loads(raw)
            choice = body["choices"][0]
            output = choice["token_ids"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ClientError(f"unexpected /v1/completions reply: {raw[:300]!r}") from exc
        if output is None:
            raise ClientError("the server returned no token_ids (does it support return_token_ids?)")
        prompt_ids = choice.get("prompt_token_ids") or body.get("prompt_token_ids") or list(prompt_token_ids)
        metrics = body.get("metrics") or choice.get("metrics") or {}
        return Completion(
            prompt_token_ids=list(prompt_ids),
            output_token_ids=list(output),
            finish_reason=choice.get("finish_reason") or "length",
            spec_decode=metrics.get("speculative_decoding") if isinstance(metrics, dict) else None,
            fingerprint=body.get("system_fingerprint"),
        )


def answers_health(base_url: str, timeout_s: float) -> bool:
    """Whether base_url's /health answers 200 now (a launched server's or an attached one's)."""
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False
