"""The nightly loop against a careless user: files edited while a night runs, nights recorded out of clock order."""

from __future__ import annotations

import hashlib
import json

import pytest
import yaml

from checkpoints import make_profile
from qual.harness.execute import execute
from qual.harness.plan import make_plan, run_options

STRICT = {"rules": [{"check": "candidate_runnable"}, {"check": "acceptance_floor", "min_rate": 0.0}]}


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    return make_profile(tmp_path_factory.mktemp("nightly"), max_tokens=8)


@pytest.mark.parametrize("edit", ["broken", "stricter", "deleted"])
def test_a_gate_edited_while_the_arms_run_judges_by_the_rules_read_at_the_start(profile, tmp_path, edit):
    """A night's verdict, run.json and provenance all name the gate as it was when the night began: a `git pull` or an
    editor touching the gate file mid-night neither loses the night (a broken file read after an hour of replay) nor
    judges it by rules its records do not name."""
    gate = tmp_path / "gate.yaml"
    gate.write_text(yaml.safe_dump(STRICT))
    digest = "sha256:" + hashlib.sha256(gate.read_bytes()).hexdigest()
    plan = make_plan(run_options(model=str(profile), dcp="1", tp=1, limit=2, gate=str(gate), out=str(tmp_path / "out"),
                                 history=str(tmp_path / "h.sqlite")))
    if edit == "broken":
        gate.write_text("rules: [{check: no_such_check}\n")
    elif edit == "stricter":  # no run of the tiny pair reaches a 100% acceptance rate
        gate.write_text(yaml.safe_dump({"rules": [{"check": "acceptance_floor", "min_rate": 1.0}]}))
    else:
        gate.unlink()
    result, _, _ = execute(plan)
    assert result.gate.passed and [c.name for c in result.gate.checks] == ["candidate_runnable", "acceptance_floor"]
    recorded = json.loads((tmp_path / "out" / "result.json").read_text())
    assert {recorded["arms"][arm]["provenance"]["gate_sha256"] for arm in ("control", "candidate")} == {digest}
    assert json.loads((tmp_path / "out" / "run.json").read_text())["inputs"]["gate"]["sha256"] == digest
