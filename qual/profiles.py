"""Model profiles (configs/models/<name>.yaml): what to load and how each engine should run it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from qual.errors import QualError

REPO_ROOT = Path(__file__).resolve().parents[1]
PROFILE_DIR = REPO_ROOT / "configs" / "models"
KNOWN_KEYS = {
    "name", "description", "target", "draft", "tokenizer", "num_speculative_tokens", "tp", "dcp", "interleave",
    "dtype", "corpus", "max_tokens", "block_size", "kv_memory_mib", "max_model_len", "vllm", "reference",
}


@dataclass(frozen=True)
class ModelProfile:
    name: str
    target: str
    draft: str | None
    num_speculative_tokens: int
    description: str = ""
    tokenizer: str | None = None
    tp: int | None = None
    dcp: int | None = None
    interleave: int = 1
    dtype: str = "float32"
    corpus: str = "humaneval"
    max_tokens: int = 64
    block_size: int = 16
    kv_memory_mib: int = 256
    max_model_len: int = 2048
    vllm: dict = field(default_factory=dict)
    reference: dict = field(default_factory=dict)
    path: str = ""

    def local_path(self, value: str | None) -> str | None:
        """Profile paths are relative to the repository root; anything else (a hub id) is passed through."""
        if value is None:
            return None
        p = Path(value)
        if not p.is_absolute() and (REPO_ROOT / p).exists():
            return str(REPO_ROOT / p)
        return str(p) if p.is_absolute() or p.exists() else value

    @property
    def target_path(self) -> str:
        return self.local_path(self.target)

    @property
    def draft_path(self) -> str | None:
        return self.local_path(self.draft)

    @property
    def tokenizer_path(self) -> str:
        return self.local_path(self.tokenizer) or self.target_path


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def load_profile(name_or_path: str) -> ModelProfile:
    """A profile by name (configs/models/NAME.yaml) or by path."""
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        path = PROFILE_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise QualError(f"unknown model {name_or_path!r}; available: {', '.join(available_profiles())}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise QualError(f"{path}: malformed YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise QualError(f"{path}: a profile must be a mapping")
    unknown = set(data) - KNOWN_KEYS
    if unknown:
        raise QualError(f"{path}: unknown keys {', '.join(sorted(unknown))}")
    for key in ("target", "num_speculative_tokens"):
        if data.get(key) in (None, ""):
            raise QualError(f"{path}: missing {key!r}")
    data.setdefault("name", path.stem)
    try:
        return ModelProfile(**data, path=str(path))
    except TypeError as exc:
        raise QualError(f"{path}: {exc}") from None
