"""Corpus records: one request, one corpus, and the fingerprint that identifies its content."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CATEGORY = "default"
# A bound on a request's max_tokens as a number (Arrow stores it as int64); the arm's max_model_len is the
# real limit, which the plan checks.
MAX_TOKENS = 2**31 - 1


ROLES = ("system", "user", "assistant")


@dataclass(frozen=True, slots=True)
class Message:
    """One message of a chat row. An assistant message without content (None) is the arm's own answer to the
    user message before it: the turn that message ends is generated, and the conversation goes on after it."""

    role: str  # ROLES
    content: str | None

    def to_json(self) -> dict:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True, slots=True)
class CorpusRequest:
    """One prompt to replay through both arms: raw text (`prompt`), or a conversation (`messages`) rendered with
    the target tokenizer's chat template, of one turn or of several (qual.harness.turns)."""

    id: str
    prompt: str | None
    category: str = DEFAULT_CATEGORY
    max_tokens: int | None = None
    messages: tuple[Message, ...] | None = None

    @property
    def turns(self) -> int:
        """Generated turns: one for a prompt, one per answer slot plus the last for a conversation."""
        if self.messages is None:
            return 1
        return 1 + sum(m.role == "assistant" and m.content is None for m in self.messages)

    def to_json(self) -> dict:
        """The JSONL form: optional max_tokens omitted when unset."""
        row: dict = {"id": self.id}
        if self.messages is None:
            row["prompt"] = self.prompt
        else:
            row["messages"] = [m.to_json() for m in self.messages]
        row["category"] = self.category
        if self.max_tokens is not None:
            row["max_tokens"] = self.max_tokens
        return row


@dataclass(frozen=True)
class Corpus:
    """A validated, ordered set of requests read from one file."""

    name: str
    path: Path
    requests: tuple[CorpusRequest, ...]
    fingerprint: str  # "sha256:<hex>" over the canonical JSON of the requests, in order

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def chat(self) -> bool:
        """Some request is a conversation (rendered with a chat template)."""
        return any(r.messages is not None for r in self.requests)

    @property
    def categories(self) -> dict[str, int]:
        """Request count per category, in first-seen order."""
        counts: dict[str, int] = {}
        for req in self.requests:
            counts[req.category] = counts.get(req.category, 0) + 1
        return counts


def _canonical_row(r: CorpusRequest) -> dict:
    # A prompt row keeps the four fields it always had (the shipped corpora's fingerprints stand); a chat row has
    # its messages in the prompt's place.
    row: dict = {"id": r.id, "category": r.category, "max_tokens": r.max_tokens}
    if r.messages is None:
        row["prompt"] = r.prompt
    else:
        row["messages"] = [m.to_json() for m in r.messages]
    return row


def canonical_json(requests: Iterable[CorpusRequest]) -> bytes:
    """Formatting-independent serialization: every field present, sorted keys, no whitespace."""
    rows = [_canonical_row(r) for r in requests]
    text = json.dumps(rows, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return text.encode("utf-8")


def fingerprint(requests: Iterable[CorpusRequest]) -> str:
    """ "sha256:<hex>" of canonical_json(requests); order matters, file layout does not."""
    return "sha256:" + hashlib.sha256(canonical_json(requests)).hexdigest()


def short_fingerprint(fp: str, n: int = 12) -> str:
    """The first n hex digits, for tables."""
    return fp.removeprefix("sha256:")[:n]
