"""result.json: the Result object as versioned JSON (schema in qual.result)."""

from __future__ import annotations

from pathlib import Path

from qual.result import Result, dumps, save_result


def render(result: Result) -> str:
    """result.json text."""
    return dumps(result)


def write(result: Result, path: str | Path) -> Path:
    return save_result(result, path)
