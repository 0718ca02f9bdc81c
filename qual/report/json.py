"""result.json: the Result object as versioned JSON (schema in qual.result; a sweep's in qual.sweep_result)."""

from __future__ import annotations

from pathlib import Path

from qual import sweep_result
from qual.result import Result, dumps, save_result
from qual.sweep_result import SweepResult, save_sweep


def render(result: Result | SweepResult) -> str:
    """result.json text."""
    return sweep_result.dumps(result) if isinstance(result, SweepResult) else dumps(result)


def write(result: Result | SweepResult, path: str | Path) -> Path:
    return save_sweep(result, path) if isinstance(result, SweepResult) else save_result(result, path)
