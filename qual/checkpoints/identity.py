"""A checkpoint directory's identity: one content hash over the files a run reads from it (config, weights,
tokenizer), so that a drafter swapped in at the same path is a different checkpoint.

Hashing a real checkpoint reads hundreds of gigabytes: the hash is cached by path, and reused while every file keeps
its inode, size, modification time and status-change time (CACHE_FILE in qual.paths.cache_dir()). The
status-change time is set by the kernel on every write, rename or copy into place, and no tool can set it back, so a
file replaced by one of the same size and a preserved modification time (`cp -p`, `rsync -t`) is still rehashed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from qual.paths import cache_dir
from qual.files import WriteError, write_text

# The files of a checkpoint directory a run reads (top level; weights sharded or not)
PATTERNS = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "mask_embedding.pt")
CACHE_FILE = "checkpoint-hashes.json"
_CHUNK = 1 << 22


def checkpoint_files(path: Path) -> list[Path]:
    return sorted({f for pattern in PATTERNS for f in path.glob(pattern) if f.is_file()})


def _stamp(files: list[Path]) -> list:
    stats = [(f.name, f.stat()) for f in files]
    return [[name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns] for name, st in stats]


def _hash(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:  # name and length first: moving bytes between two files changes the identity
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        with f.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    return "sha256:" + h.hexdigest()


def checkpoint_identity(path: str | Path | None) -> str | None:
    """"sha256:<hex>" over the checkpoint's files (names, sizes, bytes), or None for no local directory (a hub id
    is its own identity, recorded as the path)."""
    if path is None or not Path(path).is_dir():
        return None
    path = Path(path).resolve()
    files = checkpoint_files(path)
    stamp = _stamp(files)
    cache_path = cache_dir() / CACHE_FILE
    try:
        cache = json.loads(cache_path.read_text())
        if not isinstance(cache, dict):
            cache = {}
    except (OSError, ValueError):
        cache = {}
    hit = cache.get(str(path))
    if isinstance(hit, dict) and hit.get("stamp") == stamp and isinstance(hit.get("sha256"), str):
        return hit["sha256"]
    digest = _hash(files)
    cache[str(path)] = {"stamp": stamp, "sha256": digest}
    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        write_text(cache_path, json.dumps(cache))
    except (OSError, WriteError):
        pass  # a cache that cannot be written costs a rehash next time, nothing else
    return digest


def checkpoint_record(path: str | None, revision: str | None = None) -> dict | None:
    """What provenance records of one checkpoint: its path as given, the hub revision a profile pins, and its
    identity: the content hash of a local directory, else "hub:<id>@<revision>" ("@unpinned" where the profile
    names none: the hub's newest, which may change between nights unseen). None for no checkpoint (no drafter)."""
    if path is None:
        return None
    digest = checkpoint_identity(path)
    identity = digest if digest is not None else f"hub:{path}@{revision or 'unpinned'}"
    return {"path": str(path), "revision": revision, "identity": identity}
