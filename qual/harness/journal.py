"""Per-arm append-only journal of finished requests: what makes a killed run resumable."""

from __future__ import annotations

import json
import os
from pathlib import Path

from qual.records import RequestResult
from qual.errors import QualError


def journal_path(out_dir: Path, arm: str) -> Path:
    return out_dir / f"{arm}.requests.jsonl"


def read_journal(path: Path) -> dict[str, RequestResult]:
    """Finished requests by id; a torn last line (the process died mid-write) is ignored."""
    done: dict[str, RequestResult] = {}
    if not path.exists():
        return done
    lines = path.read_text().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = RequestResult.from_json(json.loads(line))
        except (json.JSONDecodeError, TypeError) as exc:
            if n == len(lines):
                break  # partial final write
            raise QualError(f"{path}:{n}: corrupt journal line ({exc})") from None
        done[rec.id] = rec
    return done


class Journal:
    """Appends each finished request as one fsync'd JSON line."""

    def __init__(self, path: Path):
        self.path = path
        existing = path.read_bytes() if path.exists() else b""
        if existing and not existing.endswith(b"\n"):
            # drop a torn last line before appending after it
            path.write_bytes(existing[: existing.rfind(b"\n") + 1])
        self._f = path.open("a")

    def append(self, result: RequestResult) -> None:
        self._f.write(json.dumps(result.to_json()) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()
