"""result.json: the Result object as versioned JSON (schema in qual.result; a sweep's in qual.sweep_result); and the
verdict alone (`qual compare --json`, schema VERDICT_SCHEMA): what a program reads instead of the verdict lines."""

from __future__ import annotations

from pathlib import Path

import json

from qual import sweep_result
from qual.result import Result, _finite, dumps, save_result
from qual.sweep_result import SweepResult, save_sweep


def render(result: Result | SweepResult) -> str:
    """result.json text."""
    return sweep_result.dumps(result) if isinstance(result, SweepResult) else dumps(result)


def write(result: Result | SweepResult, path: str | Path) -> Path:
    return save_sweep(result, path) if isinstance(result, SweepResult) else save_result(result, path)


VERDICT_SCHEMA = "qual.verdict/1"


def verdict(result: Result, control: str, candidate: str, files: dict[str, Path]) -> dict:
    """The verdict of one comparison: its outcome and exit, each arm's headline, the delta, every check with its
    numbers, the warnings and where the reports are."""
    cmp = result.comparison
    arms = {}
    for name, ref in (("control", control), ("candidate", candidate)):
        a = result.arms[name]
        arms[name] = {"ref": ref, "rate": a.acceptance.rate, "mean_acceptance_length": a.acceptance.mean_acceptance_length,
                      "requests": len(a.per_request), "engine_version": a.engine_version}
    return _finite({
        "schema": VERDICT_SCHEMA, "outcome": result.gate.outcome, "passed": result.gate.passed,
        "exit_code": 0 if result.gate.passed else 1, "created_at": result.created_at, **arms,
        "delta_rate": cmp.delta_rate, "delta_rate_ci95": cmp.delta_rate_ci95,
        "checks": [c.to_json() for c in result.gate.checks], "warnings": list(result.warnings),
        "files": {kind: str(path) for kind, path in files.items()},
    })


def verdict_text(result: Result, control: str, candidate: str, files: dict[str, Path]) -> str:
    return json.dumps(verdict(result, control, candidate, files), indent=2, allow_nan=False)
