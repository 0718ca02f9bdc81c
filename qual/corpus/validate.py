"""Strict line-by-line validation of corpus JSONL: every malformed line is named, none skipped.

Rules (one JSON object per line, UTF-8):
- required: "id" (non-empty string), and exactly one of "prompt" (non-blank string) or "messages" (a chat: a
  non-empty list of {"role", "content"}, role system, user or assistant, content a non-blank string; an assistant
  message with content null is the arm's own answer to the user message just before it, a turn generated before the
  conversation goes on; the last message is a user's, the one the arm answers);
- optional: "category" (non-empty string), "max_tokens" (integer, 1..MAX_TOKENS); null means absent;
- strings are text: a lone surrogate (`\\ud800`, which no UTF-8 encodes) is an error;
- the file is a regular one of at most MAX_CORPUS_BYTES (a FIFO or a device is refused unread);
- any other key is an error (a typo such as "max_token" must not pass silently), and so is a key given
  twice in one object (JSON would keep the last value silently);
- blank lines are errors; ids must be unique (a duplicate names both lines);
- a file with no requests is an error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from qual.errors import QualError
from qual.userfiles import load_json, read_bytes, text_problem

from .records import DEFAULT_CATEGORY, MAX_TOKENS, ROLES, CorpusRequest, Message

FIELDS = ("id", "prompt", "messages", "category", "max_tokens")
MESSAGE_FIELDS = ("role", "content")
# Problems spelled out in full in the one-line message; the rest are named by line number.
MAX_DETAILED = 20
_LINE_RE = re.compile(r"(?:row )?(\d+):")
MAX_CORPUS_BYTES = 256 << 20  # read whole into memory, with every request decoded: bounded (humaneval is 87 KB)


class CorpusFormatError(QualError):
    """A corpus file or source broke the format; `problems` lists every offending line."""

    def __init__(self, problems: list[str], where: str):
        self.problems = list(problems)
        self.where = where
        super().__init__(_summarize(self.problems, where))


def _summarize(problems: list[str], where: str) -> str:
    shown = "; ".join(problems[:MAX_DETAILED])
    rest = problems[MAX_DETAILED:]
    if not rest:
        return shown
    lines = sorted({line_of(p, where) for p in rest} - {0})
    listed = ", ".join(str(n) for n in lines)
    return f"{shown}; and {len(rest)} more problems in {where} on lines {listed}"


def display_path(path: Path) -> str:
    """The path as a user would type it: relative to the working directory when inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):  # OSError: the working directory was deleted (then no path is inside it)
        return str(path)


def _quote(text: str) -> str:
    # JSON quoting keeps a key or id with a newline in it on one line (and a lone surrogate as its escape).
    return json.dumps(text, ensure_ascii=text_problem(text) is not None)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def request_from_mapping(obj: Any, loc: str) -> tuple[CorpusRequest | None, list[str]]:
    """Validate one decoded record; return the request or the problems, each prefixed by loc."""
    if not isinstance(obj, dict):
        return None, [f"{loc}: expected a JSON object, got {_type_name(obj)}"]
    problems: list[str] = []
    unknown = [k for k in obj if k not in FIELDS]
    if unknown:
        names = ", ".join(_quote(k) for k in unknown)
        problems.append(f"{loc}: unknown field {names} (allowed: {', '.join(FIELDS)})")
    chat = obj.get("messages") is not None
    if chat and obj.get("prompt") is not None:
        problems.append(f'{loc}: both "prompt" and "messages": a row is raw text or a chat, not both')
    for key in ("id",) if chat else ("id", "prompt"):
        if key not in obj:
            problems.append(f'{loc}: missing field "{key}"' + (' (or "messages")' if key == "prompt" else ""))
        elif not isinstance(obj[key], str):
            problems.append(f'{loc}: field "{key}" must be a string, got {_type_name(obj[key])}')
        elif not obj[key].strip():
            problems.append(f'{loc}: field "{key}" is empty')
        elif text_problem(obj[key]):
            problems.append(f'{loc}: field "{key}": {text_problem(obj[key])}')
    messages, message_problems = _messages(obj["messages"], loc) if chat else (None, [])
    problems += message_problems
    category = obj.get("category")
    if category is not None:
        if not isinstance(category, str):
            problems.append(f'{loc}: field "category" must be a string, got {_type_name(category)}')
        elif not category.strip():
            problems.append(f'{loc}: field "category" is empty')
        elif text_problem(category):
            problems.append(f'{loc}: field "category": {text_problem(category)}')
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None:
        # bool is an int subclass in Python; true/false is never a token count.
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            problems.append(
                f'{loc}: field "max_tokens" must be an integer, got {_type_name(max_tokens)}'
            )
        elif max_tokens < 1:
            problems.append(f'{loc}: field "max_tokens" must be >= 1, got {max_tokens}')
        elif max_tokens > MAX_TOKENS:
            shown = str(max_tokens) if len(str(max_tokens)) <= 24 else f"{str(max_tokens)[:24]}..."
            problems.append(f'{loc}: field "max_tokens" must be <= {MAX_TOKENS}, got {shown}')
    if problems:
        return None, problems
    return CorpusRequest(
        id=obj["id"],
        prompt=None if chat else obj["prompt"],
        category=category if category is not None else DEFAULT_CATEGORY,
        max_tokens=max_tokens,
        messages=messages,
    ), []


def _messages(value: Any, loc: str) -> tuple[tuple[Message, ...] | None, list[str]]:
    """A chat row's messages, or the problems with them (each naming the message by its index)."""
    if not isinstance(value, list) or not value:
        what = "an empty list" if isinstance(value, list) else _type_name(value)
        return None, [f'{loc}: field "messages" must be a non-empty list of {{"role", "content"}}, got {what}']
    problems: list[str] = []
    out: list[Message] = []
    for i, m in enumerate(value):
        at = f'{loc}: messages[{i}]'
        if not isinstance(m, dict):
            problems.append(f"{at}: expected an object, got {_type_name(m)}")
            continue
        unknown = [k for k in m if k not in MESSAGE_FIELDS]
        if unknown:
            problems.append(f"{at}: unknown field {', '.join(_quote(k) for k in unknown)} (allowed: role, content)")
        role, content = m.get("role"), m.get("content", "")
        if role not in ROLES:
            shown = _quote(role) if isinstance(role, str) else _type_name(role)
            problems.append(f"{at}: role must be one of {', '.join(ROLES)}, got {shown}")
        if content is None:
            before = value[i - 1] if i else None
            if role != "assistant":
                problems.append(f"{at}: content null is an answer to generate: only an assistant message has it")
            elif not isinstance(before, dict) or before.get("role") != "user":
                problems.append(f"{at}: an answer to generate (content null) must follow a user message")
        elif not isinstance(content, str):
            problems.append(f"{at}: content must be a string (or null: an answer to generate), got "
                            f"{_type_name(content)}")
        elif not content.strip():
            problems.append(f"{at}: content is empty")
        elif text_problem(content):
            problems.append(f"{at}: content: {text_problem(content)}")
        out.append(Message(role, content))
    last = value[-1]
    if not problems and (not isinstance(last, dict) or last.get("role") != "user"):
        problems.append(f"{loc}: the last message must be a user's (the one the arm answers)")
    return (None, problems) if problems else (tuple(out), [])


def duplicate_problems(located: Iterable[tuple[str, CorpusRequest]]) -> list[str]:
    """One problem per repeated id, naming both locations."""
    problems: list[str] = []
    first_seen: dict[str, str] = {}
    for loc, req in located:
        if req.id in first_seen:
            problems.append(f"{loc}: duplicate id {_quote(req.id)} (first at {first_seen[req.id]})")
        else:
            first_seen[req.id] = loc
    return problems


def check_requests(
    located: list[tuple[str, CorpusRequest]], where: str
) -> tuple[CorpusRequest, ...]:
    """Reject duplicate ids and emptiness over (location, request) pairs already validated."""
    problems = duplicate_problems(located)
    if problems:
        raise CorpusFormatError(problems, where)
    if not located:
        raise CorpusFormatError([f"{where}: corpus is empty (no requests)"], where)
    return tuple(req for _, req in located)


def parse_jsonl_bytes(data: bytes, where: str) -> tuple[CorpusRequest, ...]:
    """Parse and validate a whole JSONL document; raise CorpusFormatError naming every bad line."""
    problems: list[str] = []
    located: list[tuple[str, CorpusRequest]] = []
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the newline that ends the last line does not start another
    for lineno, raw in enumerate(lines, start=1):
        loc = f"{where}:{lineno}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            problems.append(f"{loc}: not valid UTF-8 (byte {exc.start})")
            continue
        if not text.strip():
            problems.append(f"{loc}: blank line")
            continue
        try:  # the bounded loader: a key given twice, deep nesting, an integer beyond 64 bits are each refused
            obj = load_json(text, where, lineno)
        except QualError as exc:
            problems.append(str(exc))
            continue
        req, errs = request_from_mapping(obj, loc)
        if errs:
            problems.extend(errs)
        else:
            located.append((loc, req))
    # Duplicates are reported alongside format problems so one run shows everything.
    problems.extend(duplicate_problems(located))
    if problems:
        problems.sort(key=lambda p: line_of(p, where))
        raise CorpusFormatError(problems, where)
    return check_requests(located, where)


def line_of(problem: str, where: str) -> int:
    """The line (or row) number a problem names, 0 when it names none."""
    match = _LINE_RE.match(problem[len(where) + 1 :])
    return int(match.group(1)) if match else 0


def read_corpus_bytes(path: Path) -> bytes:
    """A corpus file's bytes: a regular file of at most MAX_CORPUS_BYTES (a FIFO or /dev/zero is refused)."""
    where = display_path(path)
    try:
        return read_bytes(path, MAX_CORPUS_BYTES, "corpus file", where)
    except FileNotFoundError:
        raise QualError(f"{where}: no such corpus file") from None
    except OSError as exc:
        raise QualError(f"{where}: cannot read: {exc.strerror}") from None


def parse_jsonl(path: Path) -> tuple[CorpusRequest, ...]:
    """Read and validate a corpus JSONL file."""
    return parse_jsonl_bytes(read_corpus_bytes(path), display_path(path))
