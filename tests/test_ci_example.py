"""The example CI workflow (docs/ci/github-nightly.yml) opens no door: inputs reach the shell through `env:`
only, and the job's token may read the repository, nothing more."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

WORKFLOW = Path(__file__).resolve().parents[1] / "docs" / "ci" / "github-nightly.yml"
# An expression spliced into a script: `${{ inputs.x }}` there runs whatever the input says.
EXPRESSION = re.compile(r"\$\{\{")
READ_ONLY = {"read", "none"}


def _steps(workflow: dict) -> list[dict]:
    return [step for job in workflow["jobs"].values() for step in job.get("steps", [])]


def test_no_expression_is_interpolated_into_a_run_line():
    workflow = yaml.safe_load(WORKFLOW.read_text())
    runs = [(step.get("name", "?"), step["run"]) for step in _steps(workflow) if "run" in step]
    assert runs, "the workflow has shell steps"
    spliced = [name for name, script in runs if EXPRESSION.search(script)]
    assert spliced == [], f"steps interpolating ${{{{ }}}} into a shell line: {spliced}"
    inputs = [name for name, script in runs if "inputs." in script]
    assert inputs == [], f"steps naming workflow inputs in a shell line: {inputs}"


def test_permissions_are_least_privilege():
    workflow = yaml.safe_load(WORKFLOW.read_text())
    top = workflow.get("permissions")
    assert isinstance(top, dict) and top.get("contents") == "read", top
    assert set(top.values()) <= READ_ONLY, top
    for name, job in workflow["jobs"].items():  # no job widens what the workflow grants
        assert set((job.get("permissions") or {}).values()) <= READ_ONLY, name
