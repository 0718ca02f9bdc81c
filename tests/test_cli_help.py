"""Help as people read it, walked over every command: each command and option says what it does, values are written
as words (never `<str>`, never `{DIR}`), an option whose values are a vocabulary (qual/options.py, the engine
registry) lists them, and `qual run --help` groups its options in panels."""

from __future__ import annotations

import re

import pytest
import typer.main
from typer.testing import CliRunner

from qual.cli.main import _register, app
from qual.engines.registry import ENGINES
from qual.options import DEVICES, DRAFT_KV_MODES, DSA_TOPK_MODES, DTYPES

# Every flag that takes a value of one of the vocabularies, and its values
VOCABULARY = {"--engine": ENGINES, "--device": DEVICES, "--dtype": DTYPES, "--draft-kv": DRAFT_KV_MODES,
              "--dsa-topk": DSA_TOPK_MODES}
NARROWER = {("toy", "train", "--device"): ("cuda", "cpu")}  # the trainer's own devices: one GPU or the CPU


def _commands(group, path=()):
    yield path, group
    for name, sub in getattr(group, "commands", {}).items():
        yield from _commands(sub, (*path, name))


@pytest.fixture(scope="module")
def commands():
    _register()
    return list(_commands(typer.main.get_command(app)))


@pytest.fixture(scope="module")
def helps(commands):
    runner = CliRunner()
    wide = {"COLUMNS": "200", "TERMINAL_WIDTH": "200"}
    return {path: runner.invoke(app, [*path, "--help"], prog_name="qual", env=wide).output for path, _ in commands}


def test_every_command_and_option_says_what_it_does(commands):
    assert len(commands) > 15
    silent = [" ".join(path) for path, command in commands if path and not (command.help or "").strip()]
    silent += [f"{' '.join(path)} {p.opts[0] if getattr(p, 'opts', None) else p.name}" for path, command in commands
               for p in command.params if not (getattr(p, "help", None) or "").strip()]
    assert silent == []


def test_values_are_written_in_words(helps):
    """No typer type placeholder (`<str>`, `<int range>`) and no braced argument (`{DIR}`, `{a}`) in any help."""
    bad = {" ".join(path): re.findall(r"<(?:str|int|float|path|bool|list)[^>]*>|\{[A-Za-z_]+\}", text)
           for path, text in helps.items()}
    assert {k: v for k, v in bad.items() if v} == {}
    assert "Usage: qual history publish [OPTIONS] DIR" in helps[("history", "publish")]
    assert "Usage: qual compare [OPTIONS] CONTROL CANDIDATE" in helps[("compare",)]


def test_every_vocabulary_option_lists_its_values(commands):
    checked = []
    for path, command in commands:
        for p in command.params:
            flag = next((o for o in getattr(p, "opts", ()) if o in VOCABULARY), None)
            if flag is None:
                continue
            values = NARROWER.get((*path, flag), VOCABULARY[flag])
            said = f"{p.metavar or ''} {p.help or ''}"
            assert all(v in said for v in values), (path, flag, said)
            checked.append((" ".join(path), flag))
    assert ("run", "--engine") in checked and ("run", "--dsa-topk") in checked and ("doctor", "--engine") in checked


def test_run_help_groups_its_options(helps):
    text = helps[("run",)]
    panels = re.findall(r"╭─ (.+?) ─", text)
    assert panels == ["Options", "What runs", "Engine knobs", "The corpus", "Gate and baseline", "Outputs",
                      "Servers already running (--engine attach)"]
    assert re.search(r"--limit\s+N\s+Replay the corpus's first N rows: requests of a prompt corpus, conversations of "
                     r"a\s+chat\s+corpus", text)
    assert re.search(r"--tp\s+N\s+TP size of both arms \(default: the profile's, else TP follows --dcp", text)


@pytest.mark.parametrize("argv,words", [
    (["run", "--device", "gpu", "--dry-run"], "error: --device: must be cpu, cuda or cuda:N (got 'gpu')"),
    (["run", "--engine", "warp", "--dry-run"], "error: --engine must be one of reference, vllm, attach (got 'warp')"),
    (["run", "--dcp", "3", "--dry-run"], "is not divisible by tp=3 (TP follows --dcp unless --tp is given)"),
])
def test_refusals_are_in_words(capsys, argv, words):
    from qual.cli.main import run_app

    _register()
    assert run_app(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(words) and "^(" not in err, err
