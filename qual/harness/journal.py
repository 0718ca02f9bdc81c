"""Per-arm append-only journal of finished requests: what makes a killed run resumable."""

from __future__ import annotations

import json
from pathlib import Path

from qual.errors import QualError
from qual.files import AppendOnly, WriteError
from qual.records import RecordError, RequestResult
from qual.userfiles import read_text

MAX_JOURNAL_BYTES = 1 << 30  # a run's finished requests, every token of them: bounded like result.json


def journal_path(out_dir: Path, arm: str) -> Path:
    return out_dir / f"{arm}.requests.jsonl"


def read_journal(path: Path, num_speculative_tokens: int | None = None) -> dict[str, RequestResult]:
    """Finished requests by id, each checked for internal consistency (a hand-edited record is exit 2, naming
    its line and field); a torn last line (the process died mid-write) is ignored."""
    done: dict[str, RequestResult] = {}
    if not path.exists():
        return done
    text = read_text(path, MAX_JOURNAL_BYTES, "journal")  # a FIFO or device in its place is refused, not read
    lines = text.splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            if n == len(lines) and not text.endswith("\n"):
                break  # partial final write
            raise QualError(f"{path}:{n}: corrupt journal line ({exc})") from None
        try:
            rec = RequestResult.from_json(data, num_speculative_tokens)
        except RecordError as exc:
            raise QualError(f"{path}:{n}: {exc}") from None
        if rec.id in done:
            raise QualError(f"{path}:{n}: request {rec.id} is journaled twice")
        done[rec.id] = rec
    return done


class Journal:
    """Appends each finished request as one fsync'd JSON line (a failed write leaves the lines before it)."""

    def __init__(self, path: Path):
        self.path = path
        existing = path.read_bytes() if path.exists() else b""
        if existing and not existing.endswith(b"\n"):
            try:  # drop a torn last line before appending after it
                with path.open("r+b") as f:
                    f.truncate(existing.rfind(b"\n") + 1)
            except OSError as exc:
                raise WriteError(path, exc) from None
        self._file = AppendOnly(path)

    def append(self, result: RequestResult) -> None:
        self._file.append(json.dumps(result.to_json()) + "\n")

    def close(self) -> None:
        self._file.close()
