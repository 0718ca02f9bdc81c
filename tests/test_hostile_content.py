"""Untrusted content bounded (issue 55's numbered bugs and weak spots): chat templates, checkpoint configs, tokenizers,
journals, run.json, corpus names, URLs and names that are not text. Each case was an exit 4, a hang, a silent
coercion or an accepted edit on the code before; now each is exit 2 with one line naming the file, the key or the
request (or it runs as it should)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

import pytest

from cli_inprocess import qual_in
from qual import paths
from qual.errors import QualError
from test_hostile_boundary import ENV, checkpoint_copy
from test_inputs_hostile import one_line

TOY = paths.DATA_DIR / "models" / "toy"


# ---------------------------------------------------------------- 8: chat templates bounded in time, size, depth

HOSTILE_TEMPLATES = {
    "recursion": ("{% macro f(n) %}{{ f(n+1) }}{% endmacro %}{{ f(0) }}", "calls nested deeper than Python allows"),
    "deep nesting": ("{% if 1 %}" * 400 + "x" + "{% endif %}" * 400, "not a chat template qual compiles"),
    "repeat": ("{{ 'a' * 10**10 }}", "'*': a result longer than 4194304 characters"),
    "tojson indent": ("{{ messages | tojson(indent=10**12) }}", "filter tojson: an argument of 1000000000000"),
    "nested ranges": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                      "more than 5000000 loop iterations and calls"),
    "lipsum": ("{{ lipsum(10**7) }}", "lipsum(): an argument of 10000000"),
    "110 MB prompt": ("{% for i in range(100000) %}{{ 'x' * 1100 }}{% endfor %}", "a prompt longer than 4194304"),
    "doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                 "'~': a result longer than 4194304 characters"),
    "ljust": ("{{ 'x'.ljust(10**9) }}", "ljust(): an argument of 1000000000"),
    "format width": ("{{ '%10000000000s' % 'x' }}", "'%': a format width beyond 100000"),
    "power": ("{{ 7 ** 100000000 }}", "'**': an integer wider than 65536 bits"),
    "include": ("{% include 'other.jinja' %}", "a chat template cannot include, import or extend another template"),
    "extends": ("{% extends 'base.jinja' %}", "a chat template cannot include, import or extend another template"),
}
_RENDER = """
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from qual.chat import ChatTemplate
from qual.errors import QualError
out = {}
for name, text in json.loads(sys.argv[1]).items():
    start = time.monotonic()
    try:
        ChatTemplate(text, "t.jinja").render([{"role": "user", "content": "hi"}], "request r1")
        out[name] = "rendered"
    except QualError as exc:
        out[name] = str(exc)
    except BaseException as exc:  # the old code: MemoryError, RecursionError, SyntaxError (exit 4)
        out[name] = f"{type(exc).__name__}"
    print(json.dumps([name, out[name], time.monotonic() - start]), flush=True)
"""


def test_a_hostile_chat_template_is_exit_2_naming_the_request_within_seconds():
    """Each in a child process with 3 GiB of address space and a deadline (on the code before, 'a' * 10**10 was a
    MemoryError, the nested ranges ran for minutes, the recursion was exit 4)."""
    texts = {name: text for name, (text, _) in HOSTILE_TEMPLATES.items()}
    proc = subprocess.run([sys.executable, "-c", _RENDER, json.dumps(texts)], capture_output=True, text=True,
                          timeout=240, env=ENV)
    got = {name: (message, seconds) for name, message, seconds in map(json.loads, proc.stdout.splitlines())}
    for name, (_, expected) in HOSTILE_TEMPLATES.items():
        message, seconds = got[name]
        assert expected in message, (name, message)
        assert message.startswith(("request r1: the chat template (t.jinja)", "t.jinja: not a chat template")), message


def test_the_bounds_keep_what_real_templates_do():
    from qual.chat import ChatTemplate

    text = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ loop.index }}/"
            "{{ loop.length }} {{ m.role | upper }}: {{ (m.content ~ '!') | trim | center(20) }}{% endfor %}"
            "{{ '%-5s|' % 'ok' }}{{ '{:>4}'.format(ns.n) }}{{ messages | tojson(indent=2) | length > 0 }}")
    out = ChatTemplate(text, "t.jinja").render([{"role": "user", "content": "hi"}, {"role": "assistant",
                                                                                     "content": "yo"}], "r")
    assert out == ("1/2 USER:         hi!         2/2 ASSISTANT:         yo!         ok   |   2True")


def test_a_run_with_a_recursive_template_is_exit_2_naming_the_row(tmp_path, capsys):
    template = tmp_path / "t.jinja"
    template.write_text("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")
    res = qual_in(capsys, "run", "--dcp", 1, "--corpus", "mt-bench", "--limit", 1, "--chat-template", template,
                  "--dry-run", "--out", tmp_path / "o")
    assert res.returncode == 2, res.stderr  # was: exit 4 (RecursionError)
    assert one_line(res.stderr).startswith("error: corpus mt-bench: request ") and "calls nested deeper" in res.stderr


# ---------------------------------------------------------------- 16: one render clock per run, kept in run.json


def test_strftime_now_reads_the_runs_clock_and_a_resume_reads_it_back(tmp_path):
    from qual.harness.plan import load_plan, make_plan, run_options
    from qual.harness.inputs import seal

    template = tmp_path / "t.jinja"
    template.write_text("{{ strftime_now('%Y-%m-%d %H:%M:%S.%f') }}{% for m in messages %}{{ m.content }}{% endfor %}")
    options = run_options(dcp="1", corpus="mt-bench", limit=2, chat_template=str(template), out=str(tmp_path / "o"))
    clock = datetime(2026, 12, 24, 23, 59, 59, 999999)
    first = make_plan(options, dry_run=True, render_time=clock)
    again = make_plan(options, dry_run=True, render_time=clock)  # was: no clock to give, each render its own time
    assert [r.prompt_token_ids for r in first.requests] == [r.prompt_token_ids for r in again.requests]
    later = make_plan(options, dry_run=True, render_time=datetime(2026, 12, 25))
    assert [r.prompt_token_ids for r in later.requests] != [r.prompt_token_ids for r in first.requests]
    first.out_dir.mkdir()
    first.save()
    saved = load_plan(first.out_dir)
    assert saved.render_time == clock
    data = json.loads((first.out_dir / "run.json").read_text())
    data["render_time"] = "tuesday"
    (first.out_dir / "run.json").write_text(json.dumps(seal(data)))
    with pytest.raises(QualError, match="render_time: not a time"):
        load_plan(first.out_dir)


# ---------------------------------------------------------------- 11-14: checkpoints as strictly as the drafter's


def _target_config(tmp_path: Path, change: dict, remove: tuple = ()) -> Path:
    folder = checkpoint_copy(tmp_path)
    config = json.loads((TOY / "target" / "config.json").read_text())
    config.update(change)
    for key in remove:
        config.pop(key)
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def test_a_target_given_by_flag_gets_the_position_check_its_profile_would(tmp_path, capsys):
    from qual.harness.plan import make_plan, run_options

    target = _target_config(tmp_path, {"max_position_embeddings": 512})
    plan = make_plan(run_options(dcp="1", target=str(target), limit=1), dry_run=True)
    assert {a.extra["max_model_len"] for a in plan.arms.values()} == {512}  # was: 2048, past what the target holds
    profile = tmp_path / "p.yaml"
    profile.write_text((paths.shipped("profile", "toy").read_text()
                        .replace("models/toy/target", str(TOY / "target"))
                        .replace("models/toy/draft", str(TOY / "draft"))) + "max_model_len: 2048\n")
    res = qual_in(capsys, "run", "--model", profile, "--target", target, "--dcp", 1, "--dry-run", "--out", tmp_path / "o")
    assert (res.returncode, one_line(res.stderr)) == (2, f"error: {profile}: max_model_len: 2048 is more positions than "
                                                         "the target was built for (max_position_embeddings 512 in "
                                                         f"{target / 'config.json'})")


@pytest.mark.parametrize("change,message", [
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                              "weight_block_size": [128, 128]}},
     "quantization_config: a quantized Qwen3 target is not supported"),  # 12: was exit 3 at the first matmul
    ({"hidden_size": "abc"}, "hidden_size: expected a positive integer, got 'abc'"),  # 13: was exit 4
    ({"rms_norm_eps": "x"}, "rms_norm_eps: expected a positive number, got 'x'"),
    ({"rope_theta": None, "rope_parameters": None}, "rope_theta: expected a positive number, got None"),
    ({"hidden_size": "256"}, "hidden_size: expected a positive integer, got '256'"),  # weak spot: was coerced
    ({"hidden_size": 256.7}, "hidden_size: expected a positive integer, got 256.7"),
    ({"attention_bias": "false"}, "attention_bias: expected true or false, got 'false'"),  # was: true
    ({"tie_word_embeddings": 1}, "tie_word_embeddings: expected true or false, got 1"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "1e4"}},
     "rope_parameters.rope_theta: expected a positive number, got '1e4'"),
    ({"use_sliding_window": True, "sliding_window": 64}, "use_sliding_window true is not supported"),
    ({"moe_intermediate_size": 128}, "unknown key moe_intermediate_size"),
])
def test_a_target_config_is_read_as_written_and_refused_by_key(change, message, tmp_path, capsys):
    target = _target_config(tmp_path, change)
    res = qual_in(capsys, "run", "--target", target, "--dcp", 1, "--dry-run", "--out", tmp_path / "o")
    assert res.returncode == 2, res.stderr
    assert one_line(res.stderr) == f"error: {target / 'config.json'}: {message}" or \
        one_line(res.stderr).startswith(f"error: {target / 'config.json'}: {message}"), res.stderr


def test_every_key_transformers_writes_for_qwen3_is_read_or_refused_by_name():
    """The oracle: transformers' own Qwen3Config, serialised as it saves a checkpoint."""
    from transformers import Qwen3Config

    from qual.checkpoints.qwen3 import TARGET_KEYS, TARGET_REFUSED

    written = set(Qwen3Config().to_dict()) | set(Qwen3Config(rope_scaling=None).to_diff_dict())
    assert written - TARGET_KEYS - set(TARGET_REFUSED) == set()


def test_a_malformed_tokenizer_is_exit_2(tmp_path, capsys):
    target = checkpoint_copy(tmp_path)
    (target / "tokenizer.json").unlink()
    (target / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": 5}}')
    res = qual_in(capsys, "run", "--target", target, "--dcp", 1, "--dry-run", "--out", tmp_path / "o")
    assert res.returncode == 2, res.stderr  # was: exit 4 (the tokenizers library's own exception)
    assert one_line(res.stderr).startswith(f"error: {target / 'tokenizer.json'}: not a tokenizer the tokenizers "
                                           "library reads")


def test_nan_weights_are_refused_when_loaded(tmp_path):
    import torch
    from safetensors.torch import save_file

    from qual.checkpoints.io import load_weights

    save_file({"w": torch.tensor([1.0, math.nan]), "ids": torch.tensor([1, 2])}, str(tmp_path / "model.safetensors"))
    with pytest.raises(QualError, match=r"tensor 'w' holds NaN or infinite values"):  # was: loaded
        load_weights(tmp_path)


def test_hashing_a_large_checkpoint_file_says_so_first(tmp_path, monkeypatch, capsys):
    from qual.checkpoints import identity

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(identity, "SAY_FROM_BYTES", 1 << 20)  # the toy's weights stand in for a 20 GB file
    identity.checkpoint_identity(TOY / "target")
    err = capsys.readouterr().err
    assert f"hashing {(TOY / 'target').resolve() / 'model.safetensors'} (" in err  # was: silence for 29 s
    assert "for the checkpoint's identity; cached by path after this" in err


# ---------------------------------------------------------------- 20, and names: what a path or a URL may be


def test_a_corpus_name_too_long_for_a_file_name_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("QUAL_ROOT", str(tmp_path))
    source = tmp_path / "c.jsonl"
    source.write_text('{"id": "a", "prompt": "p"}\n')
    res = qual_in(capsys, "corpus", "import", source, "--name", "n" * 300)
    assert (res.returncode, one_line(res.stderr)) == (  # was: exit 4 (ENAMETOOLONG)
        2, "error: corpus name of 300 characters: at most 128 (it names the corpus's files)")


def test_a_port_past_65535_is_named_as_a_port():
    from qual.redact import check_server_url

    for url in ("http://127.0.0.1:99999", "http://h:port"):
        with pytest.raises(QualError, match="not a valid port") as exc:  # was: "must be an http:// ... URL"
            check_server_url("--control-url", url)
        assert "must be an http" not in str(exc.value)


@pytest.mark.parametrize("flag", ["--out", "--corpus", "--history"])
def test_a_name_that_is_not_utf8_is_refused_in_words(flag, tmp_path, capsys):
    name = str(tmp_path) + "/\udcffx"  # how Python carries the byte 0xff of a command-line argument
    res = qual_in(capsys, "run", "--dcp", 1, "--dry-run", flag, name)
    assert res.returncode == 2
    assert one_line(res.stderr) == (f"error: {flag} {tmp_path}/\\xffx: not UTF-8 text; qual records names in run.json, "
                                    "result.json and the history, which hold text: rename it")  # was: pydantic's


def test_a_meta_value_that_is_not_utf8_is_refused_before_any_arm_runs(tmp_path, capsys):
    """--meta's values are recorded as text (result.json, the history): a byte that is no UTF-8 was exit 4 after both
    arms ran, and the error row's write failed on it again."""
    res = qual_in(capsys, "run", "--dcp", 1, "--dry-run", "--meta", "cluster=a\udcffb", "--out", tmp_path / "o")
    assert (res.returncode, one_line(res.stderr)) == (2, "error: --meta a\\xffb: not UTF-8 text; qual records names in "
                                                         "run.json, result.json and the history, which hold text: "
                                                         "rename it")


# ---------------------------------------------------------------- run.json's seal, journals' seals


def _run_json(tmp_path: Path, **change) -> Path:
    from qual.harness.inputs import seal
    from qual.harness.plan import RunOptions

    folder = tmp_path / "run"
    folder.mkdir(exist_ok=True)
    data = {"run_id": "0123abcd", "options": asdict(RunOptions()), "corpus": {"fingerprint": "sha256:00"},
            "inputs": {"options": {}}, **change}
    (folder / "run.json").write_text(json.dumps(seal(data)))
    return folder


def test_a_run_json_whose_seal_was_removed_is_refused(tmp_path):
    from qual.harness.plan import load_plan

    folder = _run_json(tmp_path)
    data = json.loads((folder / "run.json").read_text())
    data["options"]["limit"] = 3
    del data["sealed"]  # was: the edit passed once the seal was gone
    (folder / "run.json").write_text(json.dumps(data))
    with pytest.raises(QualError, match=r'its seal \("sealed"\) was removed'):
        load_plan(folder)


def test_a_run_json_from_before_the_seal_is_resumable_with_a_warning(tmp_path):
    from qual.harness.plan import load_plan

    folder = _run_json(tmp_path)
    data = json.loads((folder / "run.json").read_text())
    del data["sealed"], data["inputs"]
    (folder / "run.json").write_text(json.dumps(data))
    saved = load_plan(folder)
    assert saved.notes == (f"{folder / 'run.json'} was written by a qual that sealed nothing: edits to it cannot be "
                           "detected",)


def test_a_run_json_axis_is_checked_as_the_flag_is(tmp_path):
    """--resume reads --axis from run.json: one that is no axis is refused by name; one from before --axis existed
    reads as the date."""
    from qual.harness.plan import RunOptions, load_plan

    options = asdict(RunOptions())
    with pytest.raises(QualError, match="axis: .*expected one of date, engine, qual or meta:KEY"):
        load_plan(_run_json(tmp_path, options={**options, "axis": "gpu"}))
    del options["axis"]
    assert load_plan(_run_json(tmp_path, options=options)).options.axis == "date"


@pytest.mark.parametrize("run_id", ["../../etc", "", "a/b", "x" * 65, ".hidden", 5])
def test_a_run_id_that_is_no_run_id_is_refused(run_id, tmp_path):
    from qual.harness.plan import load_plan

    with pytest.raises(QualError, match="run_id: .* is not a run id"):  # was: '../../etc' accepted
        load_plan(_run_json(tmp_path, run_id=run_id))


RECORD = {"id": "a", "category": "code", "prompt_token_ids": [1, 2], "output_token_ids": [3, 4], "drafts": 1,
          "draft_tokens": 2, "accepted_tokens": 1, "accepted_per_position": [1, 0], "finish_reason": "length"}


def test_an_edited_journal_line_is_refused_by_its_seal(tmp_path):
    from qual.harness.journal import sealed, read_journal

    path = tmp_path / "candidate.requests.jsonl"
    line = sealed(RECORD)
    path.write_text(json.dumps(line) + "\n")
    assert read_journal(path, 2, 4096, sealed=True)["a"].output_token_ids == [3, 4]
    path.write_text(json.dumps({**line, "output_token_ids": [3, 5]}) + "\n")  # another token, the counts still fit
    with pytest.raises(QualError, match=r":1: edited since it was journaled"):  # was: accepted
        read_journal(path, 2, 4096)
    path.write_text(json.dumps(RECORD) + "\n")  # the seal removed
    with pytest.raises(QualError, match=r"its seal \(\"sealed\"\) is missing"):
        read_journal(path, 2, 4096, sealed=True)
    assert read_journal(path, 2, 4096, sealed=False)["a"].id == "a"  # a run begun before seals: read as it was


@pytest.mark.parametrize("key,value,expected", [
    ("hidden_size", "256", "expected an integer, got '256'"), ("hc_mult", 4.5, "expected an integer, got 4.5"),
    ("rms_norm_eps", "x", "expected a number, got 'x'"), ("norm_topk_prob", "false", "expected true or false"),
])
def test_a_glm_config_is_read_as_written_too(key, value, expected, tmp_path):
    from qual.runtime.models.glm5.config import parse_glm5_config

    raw = json.loads((paths.DATA_DIR / "models" / "glm-toy" / "target" / "config.json").read_text())
    (raw.get("text_config") or raw)[key] = value  # was: int("256"), int(4.5) = 4, bool("false") = True
    with pytest.raises(QualError, match=f"{key}: {expected}"):
        parse_glm5_config(raw, "config.json")
