"""Per-arm append-only journal of finished requests: what makes a killed run resumable."""

from __future__ import annotations

import json
from pathlib import Path

from qual.errors import QualError
from qual.files import AppendOnly
from qual.records import RecordError, RequestResult
from qual.userfiles import load_json, read_text

MAX_JOURNAL_BYTES = 1 << 30  # a run's finished requests, every token of them: bounded like result.json


def journal_path(out_dir: Path, arm: str) -> Path:
    return out_dir / f"{arm}.requests.jsonl"


def read_journal(path: Path, num_speculative_tokens: int | None = None, vocab_size: int | None = None
                 ) -> dict[str, RequestResult]:
    """Finished requests by id, each read with the strict bounded JSON loader and checked for internal consistency
    (a hand-edited record is exit 2, naming its line and field), token ids within the vocabulary where its size is
    given; a torn last line (the process died mid-write) is ignored."""
    done: dict[str, RequestResult] = {}
    if not path.is_symlink() and not path.exists():
        return done
    try:  # a FIFO or device in its place is refused, not read; a link is refused, never read through
        text = read_text(path, MAX_JOURNAL_BYTES, "journal", follow=False)
    except OSError as exc:
        raise QualError(f"{path}: unreadable journal ({exc.strerror or exc}); a journal is a file qual wrote, not a "
                        "link") from None
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        lines.pop()  # partial final write
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        data = load_json(line, str(path), n)
        try:
            rec = RequestResult.from_json(data, num_speculative_tokens)
        except RecordError as exc:
            raise QualError(f"{path}:{n}: {exc}") from None
        if vocab_size is not None:
            for name in ("prompt_token_ids", "output_token_ids"):
                bad = next((t for t in getattr(rec, name) if t >= vocab_size), None)
                if bad is not None:
                    raise QualError(f"{path}:{n}: request {rec.id}: {name}: token id {bad} is not in the target's "
                                    f"vocabulary ({vocab_size} ids)")
        if rec.id in done:
            raise QualError(f"{path}:{n}: request {rec.id} is journaled twice")
        done[rec.id] = rec
    return done


class Journal:
    """Appends each finished request as one fsync'd JSON line (a failed write leaves the lines before it)."""

    def __init__(self, path: Path):
        self.path = path
        self._file = AppendOnly(path)  # a torn last line is cut through its own descriptor, never through a link

    def append(self, result: RequestResult) -> None:
        self._file.append(json.dumps(result.to_json()) + "\n")

    def close(self) -> None:
        self._file.close()
