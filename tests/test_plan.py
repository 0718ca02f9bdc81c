"""The plan (qual.harness.plan) refuses every checkable mistake before anything starts: exit 2, one line, no run
directory, no history row, no process; `--dry-run` catches what it can see too."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from checkpoints import make_profile, make_tokenizer, tiny_config
from qual.checkpoints.qwen3 import random_target_weights, write_qwen3
from qual.cli.main import main


def qual(argv: list, capsys) -> tuple[int, str]:
    """Run the CLI in this process: (exit code, stderr)."""
    old = sys.argv
    sys.argv = ["qual", *map(str, argv)]
    try:
        with pytest.raises(SystemExit) as done:
            main()
    finally:
        sys.argv = old
    return done.value.code, capsys.readouterr().err


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_profile(tmp_path_factory.mktemp("prof"))


def _variant(base: Path, tmp_path: Path, **change) -> Path:
    data = {**yaml.safe_load(base.read_text()), **change}
    path = tmp_path / "variant.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def refused(argv: list, tmp_path: Path, capsys, words: str, dry_run: bool = True) -> None:
    """Exit 2 with one line holding `words`, nothing written; with --dry-run as well when dry_run."""
    out, db = tmp_path / "out", tmp_path / "h.sqlite"
    db_before = db.read_bytes() if db.exists() else None
    for extra in (["--dry-run"], []) if dry_run else ([],):
        code, err = qual(["run", "--out", out, "--history", db, *argv, *extra], capsys)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and words in lines[0], (extra, err)
        assert not out.exists(), "no run directory (run.json, journal) before the plan is whole"
        assert (db.read_bytes() if db.exists() else None) == db_before


@pytest.mark.parametrize("args,words", [
    (["--seed", -5], "--seed: input should be greater than or equal to 0 (got -5)"),
    (["--temperature", "nan"], "--temperature: input should be a finite number (got nan)"),
    (["--temperature", "inf"], "--temperature: input should be a finite number (got inf)"),
    (["--corpus", ""], "--corpus: string should have at least 1 character"),
    (["--out", ""], "--out: string should have at least 1 character"),
    (["--device", "tpu"], "--device: must be cpu, cuda or cuda:N (got 'tpu')"),
    (["--max-tokens", 10**9], "max_tokens 1000000000 needs 1000000"),
    (["--max-tokens", 10**12], "--max-tokens: input should be less than or equal to 2147483647"),
])
def test_bad_run_options_are_refused_in_the_plan(base, tmp_path, capsys, args, words):
    refused(["--model", base, "--dcp", 1, *args], tmp_path, capsys, words)


def test_a_prompt_longer_than_max_model_len_is_refused(base, tmp_path, capsys):
    corpus = tmp_path / "long.jsonl"
    corpus.write_text(json.dumps({"id": "long", "prompt": "x" * 60}) + "\n")
    profile = _variant(base, tmp_path, max_model_len=48)
    refused(["--model", profile, "--dcp", 1, "--corpus", corpus, "--max-tokens", 4], tmp_path, capsys,
            "request long: prompt 60 tokens + max_tokens 4 needs 68 positions, more than the control arm's "
            "max_model_len 48")


CHAT = {"id": "chat/1", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                                     {"role": "user", "content": "again"}]}


def test_a_chat_row_without_a_template_is_refused_naming_the_row(base, tmp_path, capsys):
    corpus = tmp_path / "chat.jsonl"
    corpus.write_text(json.dumps({"id": "plain", "prompt": "x"}) + "\n" + json.dumps(CHAT) + "\n")
    refused(["--model", base, "--dcp", 1, "--corpus", corpus], tmp_path, capsys,
            'corpus chat: request chat/1 is a chat ("messages") and the tokenizer ')
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    refused(["--model", base, "--dcp", 1, "--chat-template", template], tmp_path, capsys,
            f'--chat-template {template}: corpus smoke has no chat rows ("messages") for it to render')
    refused(["--model", base, "--dcp", 1, "--corpus", corpus, "--chat-template", tmp_path / "none.jinja"], tmp_path,
            capsys, "none.jinja: no such file")
    template.write_text("{{ raise_exception('no ' + messages[0].role) }}")
    refused(["--model", base, "--dcp", 1, "--corpus", corpus, "--chat-template", template], tmp_path, capsys,
            f"corpus chat: request chat/1: the chat template ({template}) refused it: no user")


def test_a_conversation_too_long_for_its_last_turn_is_refused(base, tmp_path, capsys):
    """The last turn holds every earlier answer: max_tokens each (the plan's bound), before any arm runs."""
    corpus = tmp_path / "chat.jsonl"
    corpus.write_text(json.dumps(CHAT) + "\n")
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    profile = _variant(base, tmp_path, max_model_len=40)
    refused(["--model", profile, "--dcp", 1, "--corpus", corpus, "--chat-template", template, "--max-tokens", 16],
            tmp_path, capsys, "request chat/1: its last turn's prompt, every earlier answer at max_tokens, 23 tokens + max_tokens 16 "
            "needs 43 positions")


@pytest.mark.parametrize("line,words", [
    ({"id": "a", "prompt": "x", "max_tokens": 10**20}, "max_tokens: an integer of 21 digits is beyond what qual reads "
                                                        "(64 bits)"),
    ({"id": "a", "prompt": "x", "max_tokens": 2**40}, 'field "max_tokens" must be <= 2147483647, got 1099511627776'),
    ('{"id": "a", "id": "b", "prompt": "x"}', "key 'id' given twice in one object (JSON would keep only the last)"),
])
def test_corpus_lines_that_json_or_arrow_would_misread_are_refused(base, tmp_path, capsys, line, words):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text((line if isinstance(line, str) else json.dumps(line)) + "\n")
    refused(["--model", base, "--dcp", 1, "--corpus", corpus], tmp_path, capsys, f"c.jsonl:1: {words}")


def test_a_history_file_that_is_not_a_database_is_refused(base, tmp_path, capsys):
    (tmp_path / "h.sqlite").write_bytes(b"not sqlite " * 200)
    refused(["--model", base, "--dcp", 1], tmp_path, capsys, "not a usable history database")


@pytest.fixture
def read_only_history(tmp_path):
    """A history database nobody may write: a read-only mount for root (who ignores file modes), else mode 0444."""
    folder = tmp_path / "ro"
    folder.mkdir()
    db = folder / "h.sqlite"
    import sqlite3

    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE t (x)")
    conn.close()
    if os.geteuid() != 0:
        db.chmod(0o444)
        folder.chmod(0o555)
        yield db
        folder.chmod(0o755)
        return
    data = db.read_bytes()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)]).returncode != 0:
        pytest.skip("root without mount: cannot make a read-only filesystem")
    try:
        db.write_bytes(data)
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        yield db
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_read_only_history_is_refused(base, tmp_path, capsys, read_only_history):
    for extra in (["--dry-run"], []):
        code, err = qual(["run", "--model", base, "--dcp", 1, "--out", tmp_path / "out", "--history",
                          read_only_history, *extra], capsys)
        assert code == 2 and "the history database is read-only" in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def truncated_draft(base, tmp_path_factory) -> Path:
    draft = tmp_path_factory.mktemp("trunc") / "draft"
    shutil.copytree(yaml.safe_load(base.read_text())["draft"], draft)
    weights = draft / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # a copy that stopped short
    return draft


def test_a_truncated_draft_safetensors_file_is_refused(base, tmp_path, capsys, truncated_draft):
    profile = _variant(base, tmp_path, draft=str(truncated_draft))
    refused(["--model", profile, "--dcp", 1], tmp_path, capsys, "incomplete metadata, file not fully covered")


def _target_stored_as(root: Path, dtype: torch.dtype) -> Path:
    """A tiny target whose weights (and config.json's torch_dtype) are stored as dtype, with its tokenizer."""
    cfg = tiny_config()
    path = write_qwen3(root / str(dtype).removeprefix("torch."), cfg, random_target_weights(cfg, 0, 0.15), dtype)
    return make_tokenizer(path)


@pytest.mark.parametrize("stored,run,words", [
    (torch.float16, "float32", "weights stored as float16 would be cast to float32"),
    (torch.int8, "float32", "weights stored as int8 would be cast to float32"),
    (torch.float16, "float64", "weights stored as float16 would be cast to float64"),
    (torch.bfloat16, "float16", "weights stored as bfloat16 would be cast to float16"),
])
def test_a_lossy_weight_cast_is_refused_unless_the_profile_declares_it(base, tmp_path, capsys, stored, run, words):
    target = _target_stored_as(tmp_path, stored)
    profile = _variant(base, tmp_path, target=str(target), dtype=run)
    refused(["--model", profile, "--dcp", 1], tmp_path, capsys, words)
    declared = _variant(base, tmp_path, target=str(target), dtype=run, weights_dtype=str(stored).removeprefix("torch."))
    code, err = qual(["run", "--model", declared, "--dcp", 1, "--dry-run"], capsys)
    assert code == 0, err
    from qual.harness.plan import make_plan, run_options

    plan = make_plan(run_options(model=str(declared), dcp=1), dry_run=True)
    assert {a.extra["weights_dtype"] for a in plan.arms.values()} == {str(stored).removeprefix("torch.")}


@pytest.mark.parametrize("stored,run", [(torch.bfloat16, "float32"), (torch.float32, "float64"),
                                        (torch.float32, "bfloat16")])
def test_exact_widening_and_asked_for_rounding_are_allowed(base, tmp_path, capsys, stored, run):
    profile = _variant(base, tmp_path, target=str(_target_stored_as(tmp_path, stored)), dtype=run)
    code, err = qual(["run", "--model", profile, "--dcp", 1, "--dry-run"], capsys)
    assert code == 0, err


def test_the_shipped_toy_bfloat16_weights_run_in_float32(capsys):
    code, err = qual(["run", "--model", "toy", "--dcp", 1, "--dry-run"], capsys)
    assert code == 0, err


def test_drafter_config_errors_are_exit_2_before_any_process(base, tmp_path, capsys):
    """The runtime's validate() runs in the plan (preflight): no worker ever sees these."""
    refused(["--model", _variant(base, tmp_path, num_speculative_tokens=1000), "--dcp", 2], tmp_path, capsys,
            "num_speculative_tokens=1000 exceeds what the drafter's block allows", dry_run=False)
    draft = tmp_path / "draft0"
    shutil.copytree(yaml.safe_load(base.read_text())["draft"], draft)
    cfg = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**cfg, "block_size": 0}))
    refused(["--model", _variant(base, tmp_path, draft=str(draft)), "--dcp", 2], tmp_path, capsys,
            "block_size must be an integer >= 2", dry_run=False)


# --- --resume reads run.json strictly ------------------------------------------------------------------


def _run_dir(tmp_path: Path, base: Path, change) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    data = {"run_id": "r1", "options": {"model": str(base), "dcp": 1, "history": str(tmp_path / "h.sqlite")},
            "corpus": {"fingerprint": "sha256:00"}, "arms": {}}
    change(data)
    (run / "run.json").write_text(json.dumps(data))
    return run


@pytest.mark.parametrize("change,words", [
    (lambda d: d.pop("corpus"), "run.json: corpus: missing"),
    (lambda d: d["corpus"].pop("fingerprint"), "run.json: corpus.fingerprint: missing"),
    (lambda d: d["options"].update(dcp="abc"), "run.json: options.dcp: input should be a valid integer (got 'abc')"),
    (lambda d: d["options"].update(seed=-5), "run.json: options.seed: input should be greater than or equal to 0"),
    (lambda d: d["options"].update(corpus=""), "run.json: options.corpus: string should have at least 1 character"),
    (lambda d: d["options"].update(colour="red"), "run.json: options.colour: unknown key"),
    (lambda d: d.update(options=[1]), "run.json: options: must be an object"),
    (lambda d: d.update(run_id=7), "run.json: run_id: 7 is not a run id"),
])
def test_resume_of_a_bad_run_json_is_exit_2_naming_file_and_key(base, tmp_path, capsys, change, words):
    run = _run_dir(tmp_path, base, change)
    code, err = qual(["run", "--resume", run], capsys)
    assert code == 2 and str(run) in err and words in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in run.iterdir()) == ["run.json"] and not (tmp_path / "h.sqlite").exists()


def test_a_dry_run_refuses_what_the_run_would_from_the_files_alone(base, tmp_path, capsys):
    """--dry-run checks what needs nothing started: a top-k mode for a target without sparse attention, a drafter of
    another width, a knob an attached server cannot take (each was approved by a dry run and refused by the run)."""
    refused(["--model", base, "--dcp", 1, "--dsa-topk", "union"], tmp_path, capsys, "has no sparse attention")
    wide = tmp_path / "wide"
    from checkpoints import make_draft

    make_draft(wide, hidden_size=32, head_dim=8)
    refused(["--model", base, "--dcp", 1, "--draft", wide], tmp_path, capsys, "hidden_size/vocab_size 32/")
    urls = ["--control-url", "http://127.0.0.1:9/v1", "--candidate-url", "http://127.0.0.1:9/v1"]
    refused([*urls, "--device", "cuda"], tmp_path, capsys, "--device: an attached server runs where")


def test_a_dry_run_of_a_gpu_plan_says_what_this_machine_lacks(base, tmp_path):
    """A dry run may plan a GPU run from a machine without one: it passes, and lists what the machine lacks (the run
    would be refused for it); on a machine with the GPU it lists nothing."""
    from machines import H100, NO_GPUS, Machine
    from qual.harness.plan import RunOptions, make_plan

    options = RunOptions(model=str(base), dcp=1, device="cuda", dtype="bfloat16", history=str(tmp_path / "h.sqlite"))
    assert make_plan(options, dry_run=True, inventory=NO_GPUS).lacking == ["GPUs: 1 needed (one a TP rank), none found"]
    assert make_plan(options, dry_run=True, inventory=Machine([H100])).lacking == []


def test_run_json_names_the_history_by_its_full_path(tmp_path, monkeypatch):
    """A relative --history (or the default reports/history.sqlite) is saved as a full path: `qual run --resume`
    from another directory records the run in the database it began with, not in a new one there."""
    from qual.harness.plan import RunOptions, load_plan, make_plan

    monkeypatch.chdir(tmp_path)
    for history, expected in (("h.sqlite", tmp_path / "h.sqlite"), (None, tmp_path / "reports" / "history.sqlite")):
        plan = make_plan(RunOptions(limit=2, history=history), dry_run=True)
        plan.out_dir = tmp_path / f"run-{history}"
        plan.out_dir.mkdir()
        plan.save()
        monkeypatch.chdir("/")
        assert load_plan(plan.out_dir).options.history == str(expected)
        monkeypatch.chdir(tmp_path)


def test_a_corpus_its_manifest_does_not_describe_runs_with_a_warning(base, tmp_path, capsys):
    """A corpus file edited after its import (qual corpus list: MISMATCH) runs as it is, with a warning on stderr;
    one that matches its manifest runs without."""
    from qual.paths import shipped

    smoke = shipped("corpus", "smoke")
    for name in ("smoke.jsonl", "smoke.manifest.json"):
        shutil.copy(smoke.with_name(name), tmp_path / name)
    argv = ["run", "--model", base, "--dcp", 1, "--corpus", tmp_path / "smoke.jsonl", "--dry-run",
            "--history", tmp_path / "h.sqlite"]
    code, err = qual(argv, capsys)
    assert code == 0 and "warning" not in err, err
    lines = (tmp_path / "smoke.jsonl").read_text().splitlines()
    (tmp_path / "smoke.jsonl").write_text("\n".join(lines[:-1]) + "\n")  # a row removed after the import
    code, err = qual(argv, capsys)
    assert code == 0, err
    assert f"warning: corpus smoke: {tmp_path / 'smoke.jsonl'} differs from its manifest (count {len(lines)} != " \
           f"{len(lines) - 1} in file;" in err and "the run replays the file as it is" in err, err
