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
import sys
from pathlib import Path

from qual.errors import QualError
from qual.files import write_text
from qual.paths import cache_dir
from qual.userfiles import read_chunks, read_json

# The files of a checkpoint directory a run reads (top level; weights sharded or not)
PATTERNS = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "mask_embedding.pt")
CACHE_FILE = "checkpoint-hashes.json"
MAX_CACHE_BYTES = 1 << 24  # a path and a digest per checkpoint ever hashed: a few hundred bytes each
SAY_FROM_BYTES = 4 << 30  # a file this large takes seconds to hash: the user hears of it first


def checkpoint_files(path: Path) -> list[Path]:
    return sorted({f for pattern in PATTERNS for f in path.glob(pattern) if f.is_file()})


def _stamp(files: list[Path]) -> list:
    stats = [(f.name, f.stat()) for f in files]
    return [[name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns] for name, st in stats]


def _say_size(f: Path, size: int, allocated: int) -> None:
    if size >= SAY_FROM_BYTES:
        sparse = f" ({allocated / 2**30:.1f} GiB of it on disk: a sparse file)" if allocated < size // 2 else ""
        print(f"hashing {f} ({size / 2**30:.1f} GiB){sparse} for the checkpoint's identity; cached by path after "
              "this", file=sys.stderr, flush=True)


def _hash(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:  # name and length first: moving bytes between two files changes the identity
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        for chunk in read_chunks(f, "checkpoint file", lambda size, allocated, f=f: _say_size(f, size, allocated)):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _cache(cache_path: Path) -> dict:
    """The cache of earlier hashes; anything unreadable or odd in its place (a FIFO, deep nesting, a damaged
    file) is an empty cache: it costs a rehash, nothing else."""
    try:
        cache = read_json(cache_path, MAX_CACHE_BYTES, "checkpoint hash cache")
    except (OSError, QualError):
        return {}
    return cache if isinstance(cache, dict) else {}


def checkpoint_identity(path: str | Path | None) -> str | None:
    """"sha256:<hex>" over the checkpoint's files (names, sizes, bytes), or None for no local directory (a hub id
    is its own identity, recorded as the path)."""
    if path is None or not Path(path).is_dir():
        return None
    path = Path(path).resolve()
    files = checkpoint_files(path)
    stamp = _stamp(files)
    cache_path = cache_dir() / CACHE_FILE
    cache = _cache(cache_path)
    hit = cache.get(str(path))
    if isinstance(hit, dict) and hit.get("stamp") == stamp and isinstance(hit.get("sha256"), str):
        return hit["sha256"]
    digest = _hash(files)
    cache[str(path)] = {"stamp": stamp, "sha256": digest}
    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        write_text(cache_path, json.dumps(cache))
    except (OSError, QualError):  # WriteError, or a FIFO or device where the cache would be
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
