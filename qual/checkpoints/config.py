"""A checkpoint directory's config.json, read without torch (a profile's checks and the model registry need only this)."""

from __future__ import annotations

import json
from pathlib import Path

from qual.errors import QualError


def read_config(path: str | Path) -> dict:
    """config.json of a checkpoint directory."""
    path = Path(path)
    cfg_path = path / "config.json"
    if not path.is_dir():
        raise QualError(f"checkpoint directory not found: {path}")
    if not cfg_path.is_file():
        raise QualError(f"checkpoint {path} has no config.json")
    try:
        data = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise QualError(f"{cfg_path}: malformed JSON ({exc})") from None
    if not isinstance(data, dict):
        raise QualError(f"{cfg_path}: expected a JSON object")
    return data


def field(cfg: dict, key: str, where: Path, default=...):
    """cfg[key], or default, or a QualError naming the missing field."""
    if key in cfg:
        return cfg[key]
    if default is ...:
        raise QualError(f"{Path(where) / 'config.json'}: missing field {key!r}")
    return default
