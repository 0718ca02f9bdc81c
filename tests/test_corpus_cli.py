"""`qual corpus ...` through typer's runner and, for exit codes and stderr, the real entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from typer.testing import CliRunner

import qual.cli.corpus  # noqa: F401  (registers the sub-app)
from qual.cli.main import app

runner = CliRunner()
ENTRY = [sys.executable, "-c", "from qual.cli.main import main; main()"]


def qual(*args, env=None):
    """Run the real console entry point; returns (exit code, stdout, stderr)."""
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    proc = subprocess.run(
        [*ENTRY, *args], capture_output=True, text=True, env=full_env, timeout=120
    )
    return proc.returncode, proc.stdout, proc.stderr


def test_list_shows_shipped_corpora():
    result = runner.invoke(app, ["corpus", "list"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for name, count in [("humaneval", "164"), ("mt-bench", "80"), ("gsm8k", "100"), ("smoke", "8")]:
        line = next(ln for ln in result.output.splitlines() if f" {name} " in ln)
        assert count in line and " ok " in line


def test_show_prints_literal_prompts():
    result = runner.invoke(app, ["corpus", "show", "smoke", "--limit", "8"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "smoke: 8 requests, sha256:" in result.output
    assert "<script>" in result.output and "</textarea><b>bold</b>" in result.output


def test_show_prints_a_chat_row_as_its_messages(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"id": "c", "messages": [{"role": "user", "content": "Hi"}, {
        "role": "assistant", "content": None}, {"role": "user", "content": "More"}]}) + "\n")
    result = runner.invoke(app, ["corpus", "show", str(path)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "user: Hi | assistant: (generated) | user: More" in result.output


def test_show_limit(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(
        "".join(json.dumps({"id": f"r{i}", "prompt": f"p{i}"}) + "\n" for i in range(5))
    )
    result = runner.invoke(
        app, ["corpus", "show", str(path), "--limit", "2"], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    assert "r1" in result.output and "r2" not in result.output and "3 more" in result.output


def test_import_jsonl_via_cli(tmp_path):
    src = tmp_path / "src.jsonl"
    src.write_text(
        '{"id": "a", "prompt": "hello"}\n{"id": "b", "prompt": "world", "category": "w"}\n'
    )
    env = {"QUAL_ROOT": str(tmp_path), "COLUMNS": "200"}
    result = runner.invoke(app, ["corpus", "import", str(src), "--name", "new"], env=env)
    assert result.exit_code == 0, result.output
    assert "wrote " in result.output and "2 requests" in result.output
    listing = runner.invoke(app, ["corpus", "list"], env=env)
    assert " new " in listing.output and "2" in listing.output
    verify = runner.invoke(app, ["corpus", "verify"], env=env)
    assert verify.exit_code == 0 and "5 corpora match" in verify.output  # the new one and the 4 shipped


def test_bad_line_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"id": "a", "prompt": "p"}\n{"id": "b", "prompt": 3}\n{"id": "a", "prompt": "q"}\n'
    )
    code, out, err = qual("corpus", "show", str(bad))
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert f'{bad}:2: field "prompt" must be a string, got int' in err
    assert f'{bad}:3: duplicate id "a" (first at {bad}:1)' in err


def test_cli_errors_exit_2(tmp_path):
    src = tmp_path / "src.jsonl"
    src.write_text('{"id": "a", "prompt": "p"}\n')
    env = {"QUAL_ROOT": str(tmp_path)}
    assert qual("corpus", "import", str(src), "--name", "x", env=env)[0] == 0
    # No hub: an endpoint that refuses connections stands in for "no network" (no offline flags set).
    no_hub = {
        **env,
        "HF_ENDPOINT": "http://127.0.0.1:9",
        "HF_HUB_OFFLINE": "",
        "HF_DATASETS_OFFLINE": "",
    }
    cases = [
        (("corpus", "show", "nope"), env, 'unknown corpus "nope" (available: gsm8k, humaneval, mt-bench, smoke, x;'),
        (("corpus", "import", str(src), "--name", "x"), env, "already exists: pass --force"),
        (
            ("corpus", "import", "hf:openai/gsm8k:main", "--name", "g"),
            no_hub,
            "hf:openai/gsm8k:main: no Hugging Face hub reachable",
        ),
    ]
    for args, case_env, expected in cases:
        code, _, err = qual(*args, env=case_env)
        assert code == 2, err
        assert err.startswith("error: ") and err.count("\n") == 1 and expected in err, err
    assert not (tmp_path / "corpora" / "g.jsonl").exists()
