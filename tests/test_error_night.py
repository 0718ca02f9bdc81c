"""Every night leaves a row (qual.harness.error_night): a run that ends in exit 2, 4 or 130 after its output folder
existed is an error row in the history (its exit code, the line stderr showed, what ran) and a summary.md saying why;
`--resume` finishing it replaces the error row with the real one, under the same id. A folder the user handed over
filled, or an error before the folder exists, gets neither. (Exit 3 through a real engine failure: the CI template's
nights, tests/test_ci_template.py.)

The failure is raised where the results are built, after both arms ran: the run's real path up to there."""

from __future__ import annotations

import pytest

from checkpoints import make_profile
from cli_inprocess import qual_in
from qual import history
from qual.errors import QualError
from qual.provenance import qual_commit


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    return make_profile(tmp_path_factory.mktemp("models"))


def _run(capsys, profile, tmp_path, *more):
    return qual_in(capsys, "run", "--model", profile, "--dcp", 1, "--tp", 1, "--limit", 2, "--out", tmp_path / "out",
                   "--history", tmp_path / "h.sqlite", "--meta", "ci_run=42", *more)


@pytest.mark.parametrize("raised, code, cause", [
    (QualError("the disk is full, say"), 2, "error: the disk is full, say"),
    (RuntimeError("a bug"), 4, "internal error (a bug in qual): RuntimeError: a bug; traceback in "),
    (KeyboardInterrupt(), 130, "interrupted (SIGINT)"),
])
def test_a_night_without_a_verdict_leaves_an_error_row_and_a_summary_and_resume_replaces_it(
        profile, tmp_path, capsys, monkeypatch, raised, code, cause):
    import qual.harness.execute as execute

    def fail(*args, **kwargs):
        raise raised

    with monkeypatch.context() as m:
        m.setattr(execute, "build_result", fail)
        proc = _run(capsys, profile, tmp_path)
    assert proc.returncode == code, proc.stderr
    (row,) = history.list_runs(tmp_path / "h.sqlite")
    assert (row.outcome, row.verdict, row.exit_code, row.control_rate) == ("error", "fail", code, None)
    assert row.error.startswith(cause) and row.run_dir == str(tmp_path / "out") and row.meta == {"ci_run": "42"}
    assert row.command.startswith("qual run --model") and "--meta ci_run=42" in row.command
    assert row.facts["engine"].startswith("qual-reference") and row.key is not None
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert summary.startswith("## ⛔ ERROR: qual tiny: DCP 1 → DCP 1") and f"exit {code} (" in summary
    assert cause.split(";")[0] in summary and f"qual run --resume {tmp_path / 'out'}" in summary
    listed = qual_in(capsys, "history", "list", "--history", tmp_path / "h.sqlite")
    assert f"ERROR (exit {code})" in listed.stdout
    commit = qual_commit()[0]
    assert commit, "tests run from a git checkout, whose commit every row records"
    assert row.qual_commit == commit and commit[:10] in listed.stdout  # `-` before: the error row left it empty

    resumed = qual_in(capsys, "run", "--resume", tmp_path / "out")
    assert resumed.returncode in (0, 1), resumed.stderr
    (real,) = history.list_runs(tmp_path / "h.sqlite")
    assert (real.id, real.outcome, real.error, real.exit_code) == (row.id, "pass" if resumed.returncode == 0 else "fail",
                                                                   None, resumed.returncode)
    assert real.qual_commit == row.qual_commit  # the error row spells the commit as the verdict row does
    assert not (tmp_path / "out" / "summary.md").read_text().startswith("## ⛔ ERROR")


def test_no_row_where_the_folder_was_the_users_or_never_existed(profile, tmp_path, capsys):
    filled = tmp_path / "out"
    filled.mkdir()
    (filled / "mine.txt").write_text("keep")
    proc = _run(capsys, profile, tmp_path)
    assert proc.returncode == 2 and "is not empty" in proc.stderr
    assert sorted(p.name for p in filled.iterdir()) == ["mine.txt"] and not (tmp_path / "h.sqlite").exists()
    proc = _run(capsys, profile, tmp_path, "--meta", "=x")
    assert proc.returncode == 2 and "--meta '=x': expected KEY=VALUE" in proc.stderr
    assert not (tmp_path / "h.sqlite").exists()
