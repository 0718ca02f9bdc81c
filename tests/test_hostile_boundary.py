"""Hostile inputs at the file boundary and before the work (issue 55's numbered bugs and weak spots): a write never
follows a link, a FIFO or a device never blocks, untrusted content is bounded, every place a command writes is
checked before it works. Each case failed on the code before qual/userfiles.py and qual/files.py became the one way
in and out (tests/test_io_boundary.py keeps it so); subprocesses where a hang or the process itself is the point."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli_inprocess import qual_in
from qual import history, paths
from qual.checkpoints.identity import CACHE_FILE, checkpoint_identity
from qual.errors import QualError
from qual.harness.journal import Journal, read_journal
from synthetic import synthetic_result
from test_inputs_hostile import history_rows, one_line, tree

TOY = paths.DATA_DIR / "models" / "toy"
QUAL = [sys.executable, "-m", "qual"]
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


def qual_process(*args, timeout: float = 60, cwd: str | None = None, env: dict | None = None):
    return subprocess.run([*QUAL, *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**ENV, **(env or {})})


def checkpoint_copy(tmp_path: Path, which: str = "target") -> Path:
    """The toy target (or drafter) as links to the shipped files, in a folder of its own."""
    folder = tmp_path / which
    folder.mkdir()
    for f in (TOY / which).iterdir():
        (folder / f.name).symlink_to(f)
    return folder


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "h.sqlite"
    history.record_run(path, synthetic_result(8, n_resamples=50), None)
    return path


# ---------------------------------------------------------------- 1: a journal link is never cut or appended through


def test_a_journal_that_is_a_link_is_refused_and_what_it_points_to_is_untouched(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious\nits last line has no newline")  # what a torn journal line looks like
    link = tmp_path / "candidate.requests.jsonl"
    link.symlink_to(victim)
    with pytest.raises(QualError):
        Journal(link)  # was: the torn "last line" cut through the link, then the open refused
    with pytest.raises(QualError, match="a journal is a file qual wrote, not a link"):
        read_journal(link)
    assert victim.read_bytes() == b"precious\nits last line has no newline"


def test_a_torn_last_journal_line_is_cut_and_appends_follow_whole_lines(tmp_path):
    path = tmp_path / "control.requests.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": ')
    journal = Journal(path)
    journal._file.append('{"c": 3}\n')
    journal.close()
    assert path.read_bytes() == b'{"a": 1}\n{"c": 3}\n'


# ---------------------------------------------------------------- 2: publish never deletes what it did not write


def test_publish_refuses_a_history_inside_its_folder_and_deletes_nothing(db, tmp_path, capsys):
    site = tmp_path / "site"
    assert qual_in(capsys, "history", "publish", site, "--history", db).returncode == 0
    inside = site / "h.sqlite"
    db.rename(inside)
    before = tree(site)
    res = qual_in(capsys, "history", "publish", site, "--history", inside)
    assert (res.returncode, one_line(res.stderr)) == (
        2, f"error: --history {inside}: is inside DIR {site}, which the command fills with its own files (or "
           "replaces whole): keep the history outside it")
    assert tree(site) == before and history_rows(inside) == 1  # was: exit 0, the database deleted with the old site


# ---------------------------------------------------------------- 3: a FIFO named *.safetensors


@pytest.mark.parametrize("which", ["target", "draft"])
def test_a_fifo_in_place_of_the_weights_is_refused_at_once(which, tmp_path):
    folder = checkpoint_copy(tmp_path, which)
    (folder / "model.safetensors").unlink()
    os.mkfifo(folder / "model.safetensors")
    proc = qual_process("run", f"--{which}", folder, "--dcp", 1, "--limit", 1, "--dry-run", timeout=60)  # was: a hang
    assert proc.returncode == 2, proc.stderr
    assert one_line(proc.stderr).endswith(f"{folder / 'model.safetensors'}: is a FIFO, not a safetensors file "
                                          "(only regular files are read)")


def test_loading_weights_refuses_a_fifo_at_once(tmp_path):
    folder = checkpoint_copy(tmp_path)
    (folder / "model.safetensors").unlink()
    os.mkfifo(folder / "model.safetensors")
    code = ("import sys; from qual.checkpoints.io import load_weights; from qual.errors import QualError\n"
            "try: load_weights(sys.argv[1])\nexcept QualError as exc: print(exc)")
    out = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=60, env=ENV)
    assert out.stdout.strip().endswith("is a FIFO, not a safetensors file (only regular files are read)"), out


# ---------------------------------------------------------------- 4: the trend plot


def test_a_trend_plot_replaces_a_link_and_never_writes_through_it(db, tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    plot = tmp_path / "trend.png"
    plot.symlink_to(victim)
    assert qual_in(capsys, "history", "trend", "--out", plot, "--history", db).returncode == 0
    assert victim.read_text() == "keep me"  # was: the victim became a PNG
    assert not plot.is_symlink() and plot.read_bytes().startswith(b"\x89PNG")


def test_a_trend_plot_on_a_full_disk_is_exit_2_and_leaves_nothing(db, tmp_path, capsys, monkeypatch):
    from qual import files

    def full(_fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files.os, "fsync", full)
    plot = tmp_path / "plots" / "trend.png"
    res = qual_in(capsys, "history", "trend", "--out", plot, "--history", db)
    assert (res.returncode, one_line(res.stderr)) == (2, f"error: cannot write {plot}: No space left on device")
    assert list(plot.parent.iterdir()) == []  # was: exit 4 and a 0-byte trend.png


def test_a_fifo_as_the_trend_plot_is_refused_before_the_trend(db, tmp_path):
    fifo = tmp_path / "trend.svg"
    os.mkfifo(fifo)
    proc = qual_process("history", "trend", "--out", fifo, "--history", db)  # was: a hang after the trend printed
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
    assert one_line(proc.stderr) == (f"error: {fifo}: is a FIFO; qual writes a file only where a regular file (or "
                                     "nothing) is")


# ---------------------------------------------------------------- 6, 7: every output location checked before work


@pytest.fixture
def run_dir(tmp_path):
    from qual.report import write_reports

    folder = tmp_path / "A"
    write_reports(synthetic_result(8, n_resamples=50), folder)
    return folder


@pytest.mark.parametrize("kind", ["/dev/null", "fifo", "text"])
def test_compare_checks_its_history_before_it_writes_anything(kind, run_dir, tmp_path, capsys):
    bad = Path(kind) if kind == "/dev/null" else tmp_path / "h.sqlite"
    if kind == "fifo":
        os.mkfifo(bad)
    elif kind == "text":
        bad.write_text("not a database\n" * 100)
    out = tmp_path / "cmp"
    res = qual_in(capsys, "compare", f"{run_dir}:control", f"{run_dir}:candidate", "--out", out, "--history", bad)
    assert res.returncode == 2 and one_line(res.stderr).startswith(f"error: --history {bad}: "), res.stderr
    assert not out.exists()  # was: result.json, the reports and junit.xml written, then exit 2


@pytest.mark.parametrize("inside", ["result.json", "", "control.requests.jsonl", "h.sqlite"])
def test_run_refuses_a_history_inside_its_out_before_any_arm(inside, tmp_path, capsys):
    out = tmp_path / "O"
    db = out / inside if inside else out
    res = qual_in(capsys, "run", "--dcp", 1, "--limit", 1, "--max-tokens", 2, "--out", out, "--history", db)
    assert res.returncode == 2, res.stderr
    assert one_line(res.stderr) == (f"error: --history {db}: is inside --out {out}, which the command fills with its "
                                    "own files (or replaces whole): keep the history outside it")
    assert not out.exists()  # was: both arms ran, junit.xml written, exit 2 and a 0-byte database


def _unshare() -> None:
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode:
        pytest.skip("needs a user and mount namespace (unshare -rm) to mount a small tmpfs")


def test_a_history_on_a_full_disk_is_refused_before_any_arm(tmp_path):
    _unshare()
    mnt, out = tmp_path / "mnt", tmp_path / "out"
    mnt.mkdir()
    script = (f"mount -t tmpfs -o size=1m tmpfs {mnt} && (dd if=/dev/zero of={mnt}/fill bs=64k 2>/dev/null; true) && "
              f"exec {sys.executable} -m qual run --dcp 1 --limit 1 --max-tokens 2 --out {out} --history {mnt}/h.sqlite")
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 2, proc.stderr
    line = one_line(proc.stderr)
    assert line.startswith(f"error: --history {mnt}/h.sqlite: ") and line.endswith("free space"), line
    assert not out.exists()  # was: both arms ran, then exit 2 and a 0-byte database


# ---------------------------------------------------------------- 9: journals through the strict bounded loader


RECORD = {"id": "a", "category": "code", "prompt_token_ids": [1, 2], "output_token_ids": [3, 4], "drafts": 1,
          "draft_tokens": 2, "accepted_tokens": 1, "accepted_per_position": [1, 0], "finish_reason": "length"}


@pytest.mark.parametrize("line,problem", [
    ('{"id": "a", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested deeper than 64 levels"),
    (json.dumps(RECORD).replace("[3, 4]", "[3, " + "1" + "0" * 30 + "]"), "output_token_ids[1]: an integer of 31 digits "
                                                                             "is beyond what qual reads (64 bits)"),
    (json.dumps(RECORD)[:-1] + ', "id": "b"}', "key 'id' given twice in one object (JSON would keep only the last)"),
    (json.dumps(RECORD).replace("[3, 4]", "[3, 4096]"), "request a: output_token_ids: token id 4096 is not in the "
                                                        "target's vocabulary (4096 ids)"),
])
def test_a_journal_line_is_read_strictly_and_bounded(line, problem, tmp_path):
    path = tmp_path / "candidate.requests.jsonl"
    path.write_text(json.dumps(RECORD).replace('"a"', '"z"') + "\n" + line + "\n")
    with pytest.raises(QualError) as exc:
        read_journal(path, 2, 4096)  # was: exit 4 (RecursionError, an id no tokenizer decodes), or accepted
    assert str(exc.value) == f"{path}:2: {problem}"


# ---------------------------------------------------------------- 15: a deleted working directory


def test_a_deleted_working_directory_is_one_line_and_exit_2(tmp_path):
    gone = tmp_path / "gone"
    gone.mkdir()
    code = (f"import os, sys; os.chdir({str(gone)!r}); os.rmdir({str(gone)!r}); "
            "sys.argv = ['qual', *sys.argv[1:]]; from qual.cli.main import main; main()")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", code, "run", "--dcp", "1", "--limit", "1", "--out", str(out),
                           "--history", str(tmp_path / "h.sqlite")], capture_output=True, text=True, timeout=120,
                          env=ENV)
    assert (proc.returncode, one_line(proc.stderr)) == (2, "error: the working directory no longer exists (deleted "
                                                           "after the shell entered it): cd to an existing folder and run "
                                                           "the command again")  # was: exit 4, or MKL's own exit
    assert not out.exists()


# ---------------------------------------------------------------- 17: ASCII digits only


@pytest.mark.parametrize("dcp", ["²", "٢,٤", "2,٤"])
def test_a_dcp_of_other_digits_is_refused(dcp, tmp_path, capsys):
    res = qual_in(capsys, "run", "--dcp", dcp, "--dry-run", "--out", tmp_path / "o")
    assert res.returncode == 2 and one_line(res.stderr).startswith("error: --dcp: input should be a valid integer"), \
        res.stderr  # was: '²' exit 4 (int('²')), '٢,٤' ran as 2,4


# ---------------------------------------------------------------- 18: generate's prompts file


def test_a_deeply_nested_prompts_line_is_refused(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt_token_ids": [5]}\n{"id": "b", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    res = qual_in(capsys, "generate", "--target", TOY / "target", "--prompts", prompts)
    assert (res.returncode, one_line(res.stderr)) == (2, f"error: {prompts}:2: nested deeper than 64 levels")


# ---------------------------------------------------------------- 19: the checkpoint-identity cache


def test_a_damaged_identity_cache_costs_a_rehash_and_nothing_else(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache = tmp_path / "qual" / CACHE_FILE
    cache.parent.mkdir()
    expected = checkpoint_identity(TOY / "target")
    cache.write_text("[" * 100_000 + "]" * 100_000)  # was: exit 4 (RecursionError)
    assert checkpoint_identity(TOY / "target") == expected
    assert json.loads(cache.read_text())[str((TOY / "target").resolve())]["sha256"] == expected  # rewritten whole


def test_a_fifo_as_the_identity_cache_is_passed_over(tmp_path):
    cache = tmp_path / "qual" / CACHE_FILE
    cache.parent.mkdir()
    os.mkfifo(cache)
    code = "import sys; from qual.checkpoints.identity import checkpoint_identity; print(checkpoint_identity(sys.argv[1]))"
    out = subprocess.run([sys.executable, "-c", code, str(TOY / "target")], capture_output=True, text=True, timeout=60,
                         env={**ENV, "XDG_CACHE_HOME": str(tmp_path)})  # was: a hang
    assert out.stdout.startswith("sha256:"), out.stderr


# ---------------------------------------------------------------- 5 and shown text: commands quoted, controls escaped


def test_the_reproduce_command_is_one_argument_per_value_when_pasted_into_a_shell(tmp_path):
    import shlex

    from qual.harness.plan import run_options

    opts = run_options(model="toy", target=None, draft=None, dcp="4", tp=None, engine="reference", corpus="a b;c.jsonl",
                       chat_template="$(rm -rf ~).jinja", limit=None, max_tokens=None, draft_kv=None, temperature=0.0,
                       seed=0, gate="g > x.yaml", out=None, history=None, device=None, dtype=None, dsa_topk=None,
                       baseline=None, baseline_any=False, control_url=None, candidate_url=None, api_key_env=None,
                       exclusive=False, max_concurrency=None, speedup=False)
    argv = shlex.split(opts.command())  # was: "--corpus a b;c.jsonl" split at the space, ";" ran the rest
    assert argv[argv.index("--corpus") + 1] == "a b;c.jsonl"
    assert argv[argv.index("--chat-template") + 1] == "$(rm -rf ~).jinja"
    assert argv[argv.index("--gate") + 1] == "g > x.yaml"
    assert argv[:6] == ["qual", "run", "--model", "toy", "--engine", "reference"]


def test_compare_quotes_its_reproduce_command(tmp_path, capsys):
    import shlex

    from qual.report import write_reports

    a = tmp_path / "run a; rm x"
    write_reports(synthetic_result(8, n_resamples=50), a)
    out = tmp_path / "cmp"
    assert qual_in(capsys, "compare", f"{a}:control", f"{a}:candidate", "--out", out).returncode in (0, 1)
    reproduce = json.loads((out / "result.json").read_text())["reproduce"]
    assert shlex.split(reproduce) == ["qual", "compare", f"{a}:control", f"{a}:candidate"]
    summary = (out / "summary.md").read_text()
    assert reproduce in summary


def _hostile_history(tmp_path) -> Path:
    db = tmp_path / "h.sqlite"
    result = synthetic_result(8, n_resamples=50)
    for arm in (result.control, result.candidate):
        arm.config["model"] = "toy\x1b[2J\x1b]0;owned\x07\n"
    history.record_run(db, result, str(tmp_path / "nowhere\x1b[31m" / "result.json"))
    return db


@pytest.mark.parametrize("command", [["list"], ["show", "1"], ["trend"], ["baseline", "dirs"]])
def test_history_output_shows_control_characters_escaped(command, tmp_path, capsys):
    db = _hostile_history(tmp_path)
    if command[0] == "baseline":
        history.pin(db, 1, "2026-12-01T00:00:00+00:00")
    res = qual_in(capsys, "history", *command, "--history", db)
    assert res.returncode == 0, res.stderr
    assert "\x1b" not in res.stdout and "\x07" not in res.stdout, res.stdout  # was: printed raw
    assert "\\x1b" in res.stdout


def test_publish_output_shows_control_characters_escaped(tmp_path, capsys):
    db = _hostile_history(tmp_path)
    res = qual_in(capsys, "history", "publish", tmp_path / "site", "--history", db)
    assert res.returncode == 0 and "\x1b" not in res.stdout and "nowhere\\x1b[31m" in res.stdout, res.stdout
    # nor in the pages: the plots' titles, legends, axis labels and tooltips show them escaped (XML has no place for
    # them, and matplotlib draws them as missing glyphs)
    for page in (tmp_path / "site").rglob("*.html"):
        raw = re.findall("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]", page.read_text())
        assert not raw, (page.name, raw[:3])


def test_summary_md_escapes_control_characters(tmp_path):
    from qual.report import write_reports

    result = synthetic_result(8, n_resamples=50)
    for arm in (result.control, result.candidate):
        arm.config["model"] = "toy\x1b[2J"
    result.reproduce = "qual run --corpus 'x\x1b[31m.jsonl'"
    write_reports(result, tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    assert "\x1b" not in summary and "toy\\x1b[2J" in summary and "x\\x1b[31m.jsonl" in summary


def test_an_error_naming_a_hostile_file_is_one_line_with_nothing_a_terminal_acts_on(tmp_path, capsys):
    gate = tmp_path / "gate\x1b[2J\nline.yaml"
    res = qual_in(capsys, "run", "--dcp", 1, "--gate", gate, "--dry-run", "--out", tmp_path / "o")
    assert res.returncode == 2
    line = one_line(res.stderr)  # was: two lines, the first ending in a clear-screen sequence
    assert "\x1b" not in line and "gate\\x1b[2J\\x0aline.yaml" in line


# ---------------------------------------------------------------- a run killed or refused while it writes run.json


def test_a_folder_holding_only_a_killed_runs_temporary_file_is_taken_by_out_and_explained_by_resume(tmp_path, capsys):
    out, db = tmp_path / "out", tmp_path / "h.sqlite"
    out.mkdir()
    (out / ".run.json.k1ll3d9x.tmp").write_text('{"run_id": ')  # what a kill -9 during write_text leaves
    res = qual_in(capsys, "run", "--resume", out)
    assert (res.returncode, one_line(res.stderr)) == (  # was: "no run.json there (not a qual run directory)"
        2, f"error: --resume {out}: the run stopped before its run.json was written whole, so nothing ran: start it "
           f"again (`qual run ... --out {out}`)")
    res = qual_in(capsys, "run", "--dcp", 1, "--limit", 1, "--max-tokens", 2, "-q", "--out", out, "--history", db)
    assert res.returncode in (0, 1), res.stderr  # was: "--out ... is not empty (use --resume to finish a run there)"
    assert (out / "run.json").is_file() and history_rows(db) == 1


def test_a_run_json_that_cannot_be_written_says_to_run_again_not_resume(tmp_path, capsys, monkeypatch):
    from qual.files import WriteError
    from qual.harness.plan import RunPlan

    def full(self):
        raise WriteError(self.out_dir / "run.json", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))

    monkeypatch.setattr(RunPlan, "save", full)
    out, db = tmp_path / "out", tmp_path / "h.sqlite"
    res = qual_in(capsys, "run", "--dcp", 1, "--limit", 1, "--max-tokens", 2, "-q", "--out", out, "--history", db)
    assert res.returncode == 2
    line = one_line(res.stderr)
    assert line.startswith(f"error: cannot write {out / 'run.json'}: No space left on device; nothing ran (no run.json "
                           "to resume from): free space, then run it again: `qual run --model toy")
    assert line.endswith(f"--out {out} --history {db}`") and "--resume" not in line  # was: "then qual run --resume"


# ---------------------------------------------------------------- sizes refused before reading, copies bounded


def test_a_file_larger_than_its_cap_is_refused_before_a_byte_is_read(tmp_path, monkeypatch):
    from qual import userfiles

    big = tmp_path / "huge.json"  # not result.json: tests/conftest.py validates every result.json a test leaves
    with big.open("wb") as f:
        f.truncate(20 << 30)  # 20 GB, sparse
    reads = []
    real = userfiles.os.read
    monkeypatch.setattr(userfiles.os, "read", lambda fd, n: reads.append(n) or real(fd, n))
    with pytest.raises(QualError, match=r"larger than a result file may be \(1073741824 bytes\); refused"):
        userfiles.read_bytes(big, 1 << 30, "result file")
    assert reads == []  # was: 1 GiB read, then refused
    big.unlink()


def test_publish_leaves_out_a_linked_file_past_its_cap(tmp_path, capsys):
    from qual.report import write_reports
    from qual.report.site import MAX_COPIED_BYTES
    from qual.result import load_result

    run = tmp_path / "run"
    write_reports(synthetic_result(8, n_resamples=50), run)
    with (run / "candidate.log").open("wb") as f:  # a log the report links to, 3 GB and sparse
        f.truncate(3 << 30)
    write_reports(synthetic_result(8, n_resamples=50), run)  # the report now links candidate.log
    assert 'href="candidate.log"' in (run / "report.html").read_text()
    db = tmp_path / "h.sqlite"
    history.record_run(db, load_result(run / "result.json"), str(run / "result.json"))
    site = tmp_path / "site"
    assert qual_in(capsys, "history", "publish", site, "--history", db).returncode == 0
    copied = {p.name for p in (site / "runs" / "1").iterdir()}
    assert "report.html" in copied and "candidate.log" not in copied  # was: 3 GB copied
    assert (3 << 30) > MAX_COPIED_BYTES


def test_the_reproduce_command_parses_back_to_the_same_run():
    """Every flag the reproduce command shows reads back through `qual run`'s own parser as the same options: one
    argument per value (`--meta`'s included: it was one argument '--meta KEY=VALUE', which `qual run` refuses)."""
    import shlex

    import typer

    from qual.cli.main import _register, app
    from qual.harness.plan import run_options

    _register()
    run = typer.main.get_command(app).commands["run"]
    given = dict(model="toy", target="/t a", draft="/d;b", dcp="2,4", tp=4, engine="reference",
                 corpus="a b.jsonl", chat_template="c.jinja", limit=8, max_tokens=16, draft_kv="replicated,sharded",
                 temperature=0.0, seed=3, gate="nightly-baseline", device="cpu", dtype="float32", dsa_topk=None,
                 baseline="history:last-pass", baseline_any=True, baseline_required=True,
                 meta=("ci_run=https://ci/run 1", "cluster=a'b"), axis="meta:ci_run", speedup=True)
    opts = run_options(**given)
    argv = shlex.split(opts.command())
    assert argv[:2] == ["qual", "run"]
    params = run.make_context("run", argv[2:]).params
    # what the command leaves out: where the run writes, and how it is shown
    again = run_options(**{k: v for k, v in params.items() if k not in ("out", "history", "resume", "dry_run", "quiet")})
    assert again == opts, (argv, again, opts)
