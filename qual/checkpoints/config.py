"""A checkpoint directory's config.json, read without torch (a profile's checks and the model registry need only this)."""

from __future__ import annotations

from pathlib import Path

from qual.errors import QualError
from qual.userfiles import MAX_CONFIG_BYTES, read_json
from qual.validation import shown


def read_config(path: str | Path) -> dict:
    """config.json of a checkpoint directory."""
    path = Path(path)
    cfg_path = path / "config.json"
    if not path.is_dir():
        raise QualError(f"checkpoint directory not found: {path}")
    if not cfg_path.is_file():
        raise QualError(f"checkpoint {path} has no config.json")
    try:
        data = read_json(cfg_path, MAX_CONFIG_BYTES, "config.json")
    except OSError as exc:
        raise QualError(f"{cfg_path}: unreadable ({exc.strerror or exc})") from None
    if not isinstance(data, dict):
        raise QualError(f"{cfg_path}: expected a JSON object")
    return data


def _kind(value) -> str | None:
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return None


def check_kinds(cfg: dict, defaults: dict, where: str) -> None:
    """Each key of cfg holds the JSON kind its default has (an integer where the default is one, a number, a flag,
    a string): a value is read as written, never coerced ("256" is not 256, 256.7 not 256, "false" not false).
    Keys whose default is null or a container, and null values (the default, where the format allows it), are the
    parser's to check."""
    for key, value in cfg.items():
        expected = _kind(defaults.get(key))
        if expected is None or value is None:
            continue
        got = _kind(value)
        if got != expected and not (expected == "a number" and got == "an integer"):
            raise QualError(f"{where}: {key}: expected {expected}, got {shown(value)}")


def true_or_false(value, key: str, at: str | Path) -> bool:
    """A flag of config.json `at` as written: true or false; "false", 1 or "yes" is refused by key, never coerced
    (null too: a reader that takes null as its default says so before calling)."""
    if type(value) is not bool:
        raise QualError(f"{at}: {key}: expected true or false, got {shown(value)}")
    return value


def field(cfg: dict, key: str, where: Path, default=...):
    """cfg[key], or default, or a QualError naming the missing field."""
    if key in cfg:
        return cfg[key]
    if default is ...:
        raise QualError(f"{Path(where) / 'config.json'}: missing field {key!r}")
    return default


def _positive(cfg: dict, key: str) -> int | None:
    for section in (cfg, cfg.get("text_config")):
        value = section.get(key) if isinstance(section, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def max_positions(cfg: dict) -> int | None:
    """The positions the model was built for (`max_position_embeddings`, at the top level or in a multimodal
    config's text_config), or None where the config does not say."""
    return _positive(cfg, "max_position_embeddings")


def vocab_size(cfg: dict) -> int | None:
    """The vocabulary's size (`vocab_size`, at the top level or in text_config), or None where the config does not
    say."""
    return _positive(cfg, "vocab_size")
