"""Stage 8: models/toy/MANIFEST.json — hashes, data source, hyperparameters, command, results."""

from __future__ import annotations

import json
from pathlib import Path

from qual.files import write_text
from qual.toy.data import sha256_file
from qual.userfiles import read_json

MANIFEST = "MANIFEST.json"


def file_hashes(out_dir: Path) -> dict[str, str]:
    """sha256 of every file under out_dir except the manifest itself, keyed by relative path."""
    return {
        p.relative_to(out_dir).as_posix(): sha256_file(p)
        for p in sorted(out_dir.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def write_manifest(out_dir: Path, body: dict) -> Path:
    """Write MANIFEST.json with `files` (sha256) recomputed from disk."""
    body = dict(body)
    body["files"] = file_hashes(out_dir)
    body["total_bytes"] = sum((out_dir / f).stat().st_size for f in body["files"])
    path = out_dir / MANIFEST
    write_text(path, json.dumps(body, indent=2) + "\n")
    return path


def verify_manifest(out_dir: Path) -> list[str]:
    """Files whose sha256 differs from (or is missing in) the manifest; empty when all match."""
    recorded = read_json(out_dir / MANIFEST)["files"]
    actual = file_hashes(out_dir)
    return sorted(k for k in set(recorded) | set(actual) if recorded.get(k) != actual.get(k))
