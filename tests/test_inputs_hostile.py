"""Hostile inputs (issue 34, items 4, 11, 12 and three weak spots): every one is exit 2 with one line naming the
file, line and field (or the flag), and nothing is written where it must not be. In process where the exit code
and the message are enough; a subprocess where the process itself is the point (a FIFO must not block it, /dev/zero
must not exhaust its memory, a read-only mount)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import resource
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from qual import history, paths
from qual.cli.main import main
from qual.errors import QualError
from qual.files import WriteError
from qual.report import write_reports
from qual.userfiles import MAX_DEPTH, load_json, load_yaml, read_bytes
from synthetic import synthetic_result

TOY = paths.DATA_DIR / "models" / "toy"
QUAL = [sys.executable, "-m", "qual"]
BIG_ID = "12345678901234567890123"  # 23 digits: beyond SQLite's int64


def qual(argv: list, capsys) -> tuple[int, str]:
    """The CLI in this process: (exit code, stderr)."""
    old = sys.argv
    sys.argv = ["qual", *map(str, argv)]
    try:
        with pytest.raises(SystemExit) as done:
            main()
    finally:
        sys.argv = old
    return done.value.code, capsys.readouterr().err


def qual_process(*args, timeout: float = 120, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """The CLI as its own process, its address space capped (a read of /dev/zero ends in MemoryError, not in the
    machine's memory): (the process, seconds it took)."""

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    start = time.monotonic()
    proc = subprocess.run([*QUAL, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          preexec_fn=cap, env={**os.environ, **(env or {})})
    return proc, time.monotonic() - start


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def history_rows(db: Path) -> int:
    if not db.exists():
        return 0
    with sqlite3.connect(db) as c:
        return c.execute("select count(*) from runs").fetchone()[0]


def tree(folder: Path) -> dict[str, str]:
    """Every file under folder and its sha256: what a refused command must leave as it was."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def toy_profile(tmp_path):
    """A profile file for the shipped toy pair (absolute checkpoint paths), and a writer of variants of it."""
    base = yaml.safe_load(paths.shipped("profile", "toy").read_text())
    base.update(target=str(TOY / "target"), draft=str(TOY / "draft"), max_tokens=4)

    def write(text: str | None = None, name: str = "p.yaml", **change) -> Path:
        path = tmp_path / name
        path.write_text(text if text is not None else yaml.safe_dump({**base, **change}, sort_keys=False))
        return path

    return write


def refused_run(capsys, tmp_path, *args) -> str:
    """`qual run ... --limit 1` refused with exit 2: its one line; no output folder, no history row."""
    out, db = tmp_path / "out", tmp_path / "h.sqlite"
    code, err = qual(["run", "--dcp", 1, "--limit", 1, "--out", out, "--history", db, *args], capsys)
    assert code == 2, err
    assert not out.exists() and history_rows(db) == 0
    return one_line(err)


# ---------------------------------------------------------------- item 4: a duplicate key in YAML


def test_a_gate_with_rules_twice_is_refused_naming_both_lines(tmp_path, capsys):
    # The first list fails every run (no acceptance is 100%); YAML kept only the second, which passes: exit 0.
    gate = tmp_path / "gate.yaml"
    gate.write_text("rules:\n  - {check: acceptance_floor, min_rate: 1.0}\nrules:\n  - {check: candidate_runnable}\n")
    line = refused_run(capsys, tmp_path, "--gate", gate)
    assert line == f"error: {gate}:3: key 'rules' given twice (first at line 1; YAML would keep only the last)"


def test_a_parameter_given_twice_in_one_rule_is_refused(tmp_path, capsys):
    gate = tmp_path / "gate.yaml"
    gate.write_text("rules:\n  - check: acceptance_floor\n    min_rate: 1.0\n    min_rate: 0.0\n")
    line = refused_run(capsys, tmp_path, "--gate", gate)
    assert line == (f"error: {gate}:4: rules[0]: key 'min_rate' given twice (first at line 3; "
                    "YAML would keep only the last)")


@pytest.mark.parametrize("extra,key,lines", [
    ("max_tokens: 64\nmax_tokens: 4\n", "max_tokens", (1, 2)),
    ("reference:\n  max_num_seqs: 8\n  max_num_seqs: 1\n", "reference: key 'max_num_seqs'", (2, 3)),
])
def test_a_duplicate_key_in_a_profile_is_refused(toy_profile, tmp_path, capsys, extra, key, lines):
    body = "".join(f"{k}: {json.dumps(v)}\n" for k, v in yaml.safe_load(toy_profile().read_text()).items()
                   if k not in ("max_tokens", "reference"))
    n = body.count("\n")
    profile = toy_profile(body + extra)
    line = refused_run(capsys, tmp_path, "--model", profile)
    where = f"{profile}:{n + lines[1]}: "
    assert line.startswith(f"error: {where}") and key in line, line
    assert line.endswith(f"given twice (first at line {n + lines[0]}; YAML would keep only the last)"), line


# ---------------------------------------------------------------- item 11: non-regular files, bytes actually read


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "in.jsonl"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("flag", ["--corpus", "--gate"])
@pytest.mark.parametrize("kind", ["/dev/zero", "fifo"])
def test_a_device_or_a_fifo_is_refused_at_once(flag, kind, fifo, tmp_path):
    source = fifo if kind == "fifo" else Path(kind)
    out, db = tmp_path / "out", tmp_path / "h.sqlite"
    proc, seconds = qual_process("run", "--dcp", 1, "--limit", 1, flag, source, "--out", out, "--history", db,
                                 timeout=60)
    assert proc.returncode == 2, proc.stderr
    what = "a FIFO" if kind == "fifo" else "a character device"
    assert one_line(proc.stderr).endswith(f"{source}: is {what}, not a {'corpus' if flag == '--corpus' else 'config'} "
                                          "file (only regular files are read)")
    assert seconds < 30, seconds  # before: a FIFO blocked forever, /dev/zero read until memory ran out
    assert not out.exists() and history_rows(db) == 0


def test_corpus_import_of_a_fifo_is_refused_at_once(fifo, tmp_path):
    proc, seconds = qual_process("corpus", "import", fifo, "--name", "x", env={"QUAL_ROOT": str(tmp_path)},
                                 timeout=60)
    assert proc.returncode == 2 and "is a FIFO, not a corpus file" in one_line(proc.stderr), proc.stderr
    assert seconds < 30 and not (tmp_path / "corpora").exists()


def test_the_cap_counts_bytes_read_not_the_size_stat_reports(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 11)
    assert read_bytes(path, 11) == b"x" * 11
    with pytest.raises(QualError, match=r"larger than a file may be \(10 bytes\)"):
        read_bytes(path, 10)
    # /proc files report st_size 0 and are read to their end: the cap applies to what was read
    assert os.stat("/proc/self/status").st_size == 0
    with pytest.raises(QualError, match="larger than"):
        read_bytes("/proc/self/status", 10)


# ---------------------------------------------------------------- item 12: parser limits


@pytest.mark.parametrize("field", ["prompt", "category"])
def test_a_lone_surrogate_in_a_corpus_is_refused_by_run(field, tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    record = {"id": "a", "prompt": "def f():", "category": "code", field: "x\\ud800y"}
    corpus.write_text('{"id": "ok", "prompt": "p"}\n' + json.dumps(record).replace("\\\\", "\\") + "\n")
    line = refused_run(capsys, tmp_path, "--corpus", corpus)
    assert line == f"error: {corpus}:2: {field}: a lone surrogate (\\ud800) is not text"


def test_a_lone_surrogate_in_a_corpus_is_refused_by_corpus_import(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("QUAL_ROOT", str(tmp_path / "root"))
    source = tmp_path / "src.jsonl"
    source.write_text('{"id": "a", "prompt": "p", "category": "\\udc00"}\n')
    code, err = qual(["corpus", "import", source, "--name", "x"], capsys)
    assert code == 2, err
    assert one_line(err) == f"error: {source}:1: category: a lone surrogate (\\udc00) is not text"
    assert not (tmp_path / "root").exists()


def test_deeply_nested_yaml_is_refused_at_its_line(toy_profile, tmp_path, capsys):
    gate = tmp_path / "gate.yaml"
    gate.write_text("# deep\nrules: " + "[" * 5000 + "]" * 5000 + "\n")
    assert refused_run(capsys, tmp_path, "--gate", gate) == f"error: {gate}:2: nested deeper than {MAX_DEPTH} levels"
    profile = toy_profile(toy_profile().read_text() + "vllm: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n")
    line = refused_run(capsys, tmp_path, "--model", profile)
    assert line.startswith(f"error: {profile}:") and line.endswith(f"nested deeper than {MAX_DEPTH} levels")


def test_deeply_nested_json_is_refused(toy_profile, tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "prompt": "p", "x": ' + "[" * 100000 + "]" * 100000 + "}\n")
    assert refused_run(capsys, tmp_path, "--corpus", corpus) == f"error: {corpus}:1: nested deeper than {MAX_DEPTH} levels"
    target = _target_with(tmp_path, lambda text: text.replace('"rope_parameters": {',
                                                              '"x": ' + "[" * 100000 + "]" * 100000 + ',\n  "rope_parameters": {'))
    line = refused_run(capsys, tmp_path, "--model", toy_profile(target=str(target)))
    assert line.startswith(f"error: {target / 'config.json'}:") and f"nested deeper than {MAX_DEPTH} levels" in line


@pytest.mark.parametrize("digits", [5000, 400])  # Python's int conversion limit; an int no float holds
def test_a_huge_integer_in_a_gate_is_refused(digits, tmp_path, capsys):
    gate = tmp_path / "gate.yaml"
    gate.write_text("rules:\n  - {check: candidate_runnable}\n  - {check: acceptance_floor, min_rate: "
                    + "9" * digits + "}\n")
    line = refused_run(capsys, tmp_path, "--gate", gate)
    assert line.startswith(f"error: {gate}:3: rules[1].min_rate: "), line
    assert "beyond what qual reads (64 bits)" in line


def _target_with(tmp_path: Path, edit) -> Path:
    """The toy target with its config.json edited as text (the weights linked, not copied)."""
    target = tmp_path / "target"
    target.mkdir()
    for f in (TOY / "target").iterdir():
        (target / f.name).symlink_to(f)
    (target / "config.json").unlink()
    (target / "config.json").write_text(edit((TOY / "target" / "config.json").read_text()))
    return target


def test_1e400_in_a_checkpoint_config_is_refused_naming_its_line_and_field(toy_profile, tmp_path, capsys):
    target = _target_with(tmp_path, lambda t: t.replace('"max_position_embeddings": 2048', '"max_position_embeddings": 1e400'))
    n = next(i for i, text in enumerate((target / "config.json").read_text().splitlines(), 1) if "1e400" in text)
    line = refused_run(capsys, tmp_path, "--model", toy_profile(target=str(target)))
    assert line == f"error: {target / 'config.json'}:{n}: max_position_embeddings: 1e400 is not a finite number"


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "h.sqlite"
    history.record_run(path, synthetic_result(8, n_resamples=50), "nowhere/result.json")
    return path


@pytest.mark.parametrize("command", [["history", "show"], ["history", "baseline", "pin"],
                                     ["history", "baseline", "unpin"]])
def test_a_23_digit_run_id_is_no_run(command, db, capsys):
    before = db.read_bytes()
    code, err = qual([*command, BIG_ID, "--history", db], capsys)
    assert code == 2, err
    assert one_line(err) == f"error: no run {BIG_ID} in {db} (run ids are 1 to {2**63 - 1})"
    assert db.read_bytes() == before  # nothing pinned, nothing written


@pytest.mark.parametrize("ref", [BIG_ID, f"history:{BIG_ID}", "history:" + "9" * 5000])
def test_a_baseline_id_beyond_int64_is_refused(ref, db, tmp_path, capsys):
    out = tmp_path / "out"
    code, err = qual(["run", "--dcp", 1, "--limit", 1, "--baseline", ref, "--history", db, "--out", out, "--dry-run"],
                     capsys)
    assert code == 2, err
    assert one_line(err).startswith(f"error: --baseline {ref[:37]}") and "no run can have this id" in err
    assert not out.exists() and history_rows(db) == 1


def test_an_out_path_component_over_255_characters_is_refused(db, tmp_path):
    long = tmp_path / ("a" * 300)
    proc, _ = qual_process("run", "--dcp", 1, "--limit", 1, "--out", long, "--history", tmp_path / "new.sqlite")
    assert proc.returncode == 2, proc.stderr
    assert one_line(proc.stderr) == ("error: --out: a path component of 300 bytes is longer than a file name may be "
                                     f"(255): {'a' * 40}...")
    assert history_rows(tmp_path / "new.sqlite") == 0
    result = tmp_path / "run"
    write_reports(synthetic_result(8, n_resamples=50), result)
    for args in (["compare", f"{result}:control", f"{result}:candidate", "--out", long],
                 ["history", "list", "--history", long / "h.sqlite"]):
        proc, _ = qual_process(*args)
        assert proc.returncode == 2 and "a path component of 300 bytes" in one_line(proc.stderr), proc.stderr
    for args, flag in ((["run", "--resume", long], "--resume"), (["corpus", "import", f"{long}.jsonl", "--name", "x"],
                                                                   "SOURCE")):
        proc, _ = qual_process(*args)
        assert proc.returncode == 2 and one_line(proc.stderr).startswith(f"error: {flag}: a path component of"), \
            proc.stderr


@pytest.mark.parametrize("err,remedy", [(errno.ENOSPC, "free space"), (errno.EROFS, "make its file system writable"),
                                        (errno.EACCES, "make it writable"), (errno.EIO, "fix the cause")])
def test_a_failed_write_names_the_remedy_for_its_cause(err, remedy):
    """A write that fails mid-run (the --out checks passed) advises by the error, not "free space" for all."""
    failure = WriteError(Path("/x/result.json"), OSError(err, os.strerror(err)))
    assert failure.remedy == remedy


def test_strict_json_and_yaml_name_file_line_and_field():
    for text, message in [
        ('{"a": 1,\n "b": {"c": [1, 2, 1e400]}}', "x.json:2: b.c[2]: 1e400 is not a finite number"),
        ('{"a": NaN}', "x.json:1: a: NaN is not a number JSON allows"),
        ('{\n "a": 1' + "0" * 30 + "}", "x.json:2: a: an integer of 31 digits is beyond what qual reads (64 bits)"),
        ('{"b": {"c": 1, "c": 2}}', "x.json:1: b: key 'c' given twice in one object (JSON would keep only the last)"),
        ('{"a": 1,\n "b": ["x\\ud800"]}', "x.json:2: b[0]: a lone surrogate (\\ud800) is not text"),
    ]:
        with pytest.raises(QualError) as exc:
            load_json(text, "x.json")
        assert str(exc.value) == message
    assert load_json('{"a": "\\ud83d\\ude00", "b": 1e300}', "x.json") == {"a": "\U0001F600", "b": 1e300}
    for text, message in [
        ("a: 1\nb:\n  c: 2\n  c: 3\n", "g.yaml:4: b: key 'c' given twice (first at line 3; YAML would keep only the last)"),
        ('a: ["\\ud800"]\n', "g.yaml:1: a[0]: a lone surrogate (\\ud800) is not text"),
        ("a: !!python/object:os.system x\n", "g.yaml:1: invalid YAML (could not determine a constructor for the tag "
                                             "'tag:yaml.org,2002:python/object:os.system')"),
    ]:
        with pytest.raises(QualError) as exc:
            load_yaml(text, "g.yaml")
        assert str(exc.value) == message
    # a merge key's values may be overridden (YAML's own rule, not a duplicate); an alias bomb stays cheap
    assert load_yaml("a: &x {d: 1}\nc: {<<: *x, d: 2}\n", "g.yaml") == {"a": {"d": 1}, "c": {"d": 2}}
    bomb, prev = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n", "a"
    for name in "bcdefghi":
        bomb, prev = bomb + f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]\n", name
    start = time.monotonic()
    assert len(load_yaml(bomb, "g.yaml")) == 9 and time.monotonic() - start < 1


# ---------------------------------------------------------------- weak spots


def test_max_model_len_beyond_the_target_is_a_config_error_not_an_engine_failure(toy_profile, tmp_path):
    profile = toy_profile(max_model_len=10**12)
    out, db = tmp_path / "out", tmp_path / "h.sqlite"
    proc, _ = qual_process("run", "--model", profile, "--dcp", 1, "--limit", 1, "--out", out, "--history", db)
    assert proc.returncode == 2, proc.stderr  # before: exit 3, "can't allocate memory: ... 8000000000000 bytes"
    assert one_line(proc.stderr) == (f"error: {profile}: max_model_len: 1000000000000 is more positions than the "
                                     "target was built for (max_position_embeddings 2048 in "
                                     f"{TOY / 'target' / 'config.json'})")
    assert not out.exists() and history_rows(db) == 0


def test_an_unset_max_model_len_is_the_targets_limit_where_that_is_smaller(toy_profile, tmp_path):
    from qual.profiles import load_profile

    target = _target_with(tmp_path, lambda t: t.replace('"max_position_embeddings": 2048', '"max_position_embeddings": 512'))
    assert load_profile(str(toy_profile(target=str(target)))).max_model_len == 512
    assert load_profile(str(toy_profile(target=str(target), max_model_len=256))).max_model_len == 256


def _run_dir(folder: Path) -> Path:
    """A run's directory as `qual run` leaves it: the four reports, run.json and the journals."""
    write_reports(synthetic_result(8, n_resamples=50), folder)
    (folder / "run.json").write_text("{}\n")
    for arm in ("control", "candidate"):
        (folder / f"{arm}.requests.jsonl").write_text("")
    return folder


def test_compare_refuses_an_out_that_holds_a_run(tmp_path, capsys):
    run = _run_dir(tmp_path / "A")
    before = tree(run)
    code, err = qual(["compare", f"{run}:control", f"{run}:candidate", "--out", run], capsys)
    assert code == 2, err
    assert one_line(err) == (f"error: --out {run}: holds a run (run.json); its reports would be overwritten: "
                             "give another directory")
    assert tree(run) == before
    # a comparison's own folder (no run.json) as --out of a comparison that reads its result.json
    cmp = tmp_path / "cmp"
    assert qual(["compare", f"{run}:control", f"{run}:candidate", "--out", cmp], capsys)[0] in (0, 1)
    before = tree(cmp)
    code, err = qual(["compare", f"{cmp}:control", f"{cmp}:candidate", "--out", cmp], capsys)
    assert code == 2 and "holds result.json, an input of this comparison" in one_line(err), err
    assert tree(cmp) == before


def test_compare_refuses_an_out_that_is_not_empty(tmp_path, capsys):
    """As `qual run --out`: an earlier comparison's reports, a published site or any other file is never overwritten."""
    run = _run_dir(tmp_path / "A")
    cmp, site = tmp_path / "cmp", tmp_path / "site"
    assert qual(["compare", f"{run}:control", f"{run}:candidate", "--out", cmp], capsys)[0] in (0, 1)
    site.mkdir()
    (site / "qual-site.json").write_text("{}\n")
    for out, first in ((cmp, "junit.xml, ..."), (site, "qual-site.json")):
        before = tree(out)
        code, err = qual(["compare", f"{run}:control", f"{run}:candidate", "--out", out], capsys)
        assert (code, one_line(err)) == (2, f"error: --out {out}: is not empty ({first}); the reports would overwrite "
                                            "what it holds: give another directory")
        assert tree(out) == before
    (tmp_path / "empty").mkdir()
    assert qual(["compare", f"{run}:control", f"{run}:candidate", "--out", tmp_path / "empty"], capsys)[0] in (0, 1)


@pytest.mark.parametrize("key,value,expected", [
    ("config", 5, "expected an object, got a number"), ("config", None, "expected an object, got null"),
    ("graph_capture", [], "expected an object, got an array"), ("extra", "x", "expected an object, got a string"),
    ("latency", 5, "expected an object or null, got a number"),  # was accepted: the reports went without it
    ("acceptance", 5, "expected an object, got a number"), ("per_request", {}, "expected an array, got an object"),
    ("throughput", "x", "expected an object, got a string"), ("provenance", 5, "expected an object or null, got a number"),
    ("engine_version", 5, "expected a string, got a number"), ("runnable", "yes", "expected true or false, got a string"),
    ("not_runnable_reason", [], "expected a string or null, got an array"),
    ("log_path", 5, "expected a string or null, got a number"),  # was exit 4 (a path made of an int)
    # a key missing from or unknown in the field's object: was 'malformed result (KeyError: ...)', naming no field
    ("throughput", {"a": 1}, "Throughput.__init__() got an unexpected keyword argument 'a'"),
    ("acceptance", {}, "missing key 'drafts'"),
    ("provenance", {"x": 1}, "missing key 'host'"),
])
def test_compare_refuses_a_damaged_arm_field_by_name(key, value, expected, tmp_path, capsys):
    """qual compare reads them as the types result.json writes: another JSON type, or a key missing or unknown
    inside, is the file's fault, not a bug (exit 4) nor a report that silently leaves the field out."""
    run = _run_dir(tmp_path / "A")
    data = json.loads((run / "result.json").read_text())
    data["arms"]["candidate"][key] = value
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    code, err = qual(["compare", f"{run}:control", edited, "--out", tmp_path / "cmp"], capsys)
    assert (code, one_line(err)) == (2, f"error: {edited}: arms.candidate.{key}: {expected}")
    assert not (tmp_path / "cmp").exists()


def test_an_existing_out_on_a_read_only_file_system_says_so(toy_profile, tmp_path):
    mnt, db = tmp_path / "mnt", tmp_path / "h.sqlite"
    mnt.mkdir()
    script = (f"mount -t tmpfs tmpfs {mnt} && mkdir {mnt}/out && mount -o remount,ro {mnt} && "
              f"exec {sys.executable} -m qual run --model {toy_profile()} --dcp 1 --limit 1 --out {mnt}/out "
              f"--history {db}")
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs a user and mount namespace (unshare -rm) to mount a read-only tmpfs")
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert one_line(proc.stderr) == (f"error: --out {mnt}/out: cannot write in this directory (its file system is "
                                     "mounted read-only)")
    assert "free space" not in proc.stderr and history_rows(db) == 0


@pytest.mark.parametrize("model,ids,needle", [
    ("toy", [5, 99_999_999], "request 'a': token id 99999999 is not in the target's vocabulary (4096 ids)"),
    ("glm-toy", [5, 4096], "request 'a': token id 4096 is not in the target's vocabulary (4096 ids)"),  # text_config
    ("toy", [5] * 2040, "request 'a': prompt 2040 tokens + max_tokens 8 needs 2049 positions, more than the target "
                        "was built for (max_position_embeddings 2048 in "),
    ("glm-toy", [5] * 2040, "max_position_embeddings 2048 in "),
])
def test_generate_refuses_ids_past_the_vocabulary_and_prompts_past_the_positions(model, ids, needle, tmp_path, capsys):
    """An id past the embedding table was an internal error (exit 4); a prompt past max_position_embeddings
    decoded silently. Both are the prompts file's mistake: exit 2, before any rank starts."""
    from cli_inprocess import qual_in

    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "a", "prompt_token_ids": ids}) + "\n")
    target = paths.DATA_DIR / "models" / model / "target"
    res = qual_in(capsys, "generate", "--target", target, "--prompts", tmp_path / "p.jsonl", "--max-tokens", 8)
    assert res.returncode == 2 and needle in res.stderr, res.stderr
