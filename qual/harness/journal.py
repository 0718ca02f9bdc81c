"""Per-arm append-only journal of finished requests: what makes a killed run resumable.

Each line is one request's record with a digest of itself ("sealed"), as run.json carries one: a line edited by hand
(another token, a count) no longer matches and is refused. A run.json that says its journals are sealed (qual wrote
both) makes a line without its seal an edit too."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from qual.errors import QualError
from qual.files import AppendOnly
from qual.records import RecordError, RequestResult
from qual.userfiles import load_json, read_text

MAX_JOURNAL_BYTES = 1 << 30  # a run's finished requests, every token of them: bounded like result.json


SEAL = "sealed"


def journal_path(out_dir: Path, arm: str) -> Path:
    return out_dir / f"{arm}.requests.jsonl"


def _digest(record: dict) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(record, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def sealed(record: dict) -> dict:
    """A request's record as a journal line holds it: with a digest of the rest."""
    rest = {k: v for k, v in record.items() if k != SEAL}
    return {**rest, SEAL: _digest(rest)}


def read_journal(path: Path, num_speculative_tokens: int | None = None, vocab_size: int | None = None,
                 sealed: bool = False) -> dict[str, RequestResult]:
    """Finished requests by id, each read with the strict bounded JSON loader, its seal checked (required where
    `sealed`) and checked for internal consistency (a hand-edited record is exit 2, naming its line and field),
    token ids within the vocabulary where its size is given; a torn last line (the process died mid-write) is
    ignored."""
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
        if isinstance(data, dict) and SEAL in data:
            seal = data.pop(SEAL)
            if seal != _digest(data):
                raise QualError(f"{path}:{n}: edited since it was journaled (its digest no longer matches): a resumed "
                                "run must be the run that started; start a new run instead")
        elif sealed:
            raise QualError(f"{path}:{n}: its seal (\"{SEAL}\") is missing, and this run's journals are sealed: the "
                            "line was edited; start a new run instead")
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
        self._file.append(json.dumps(sealed(result.to_json())) + "\n")

    def close(self) -> None:
        self._file.close()
