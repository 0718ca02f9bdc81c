"""`qual run`'s attach-mode options without a server: refused combinations (exit 2) and an unreachable URL (exit 3),
all before anything is written."""

from __future__ import annotations

import signal
import sys
from types import SimpleNamespace

import pytest

from qual.engines.vllm.server import free_port

URLS = ["--control-url", "http://127.0.0.1:9", "--candidate-url", "http://127.0.0.1:9"]


@pytest.fixture
def qual(capsys):
    """`qual run ARGS` through the console entry point, in this process (a subprocess would cost seconds each)."""
    from qual.cli.main import main

    def call(*args):
        argv, handler = sys.argv, signal.getsignal(signal.SIGTERM)
        sys.argv = ["qual", "run", *map(str, args)]
        try:
            main()
            code = 0
        except SystemExit as exc:
            code = exc.code
        finally:
            sys.argv = argv
            signal.signal(signal.SIGTERM, handler)  # main() installs its own
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    return call


@pytest.mark.parametrize("args,needle", [
    (["--exclusive"], "--exclusive applies to attached servers"),
    (["--max-concurrency", "4"], "--max-concurrency applies to attached servers"),
    (["--api-key-env", "K"], "--api-key-env applies to attached servers"),
    (["--engine", "vllm", *URLS], "--control-url applies to attached servers (--control-url, --candidate-url); "
                                  "--engine vllm starts its own"),
    (["--control-url", "http://127.0.0.1:9"], "--engine attach attaches to running servers: give --candidate-url"),
    (["--engine", "attach"], "give --control-url and --candidate-url"),
    (["--control-url", "127.0.0.1:9", "--candidate-url", "http://127.0.0.1:9"], "--control-url must be an http://"),
    ([*URLS, "--max-concurrency", "0"], "--max-concurrency: input should be greater than or equal to 1 (got 0)"),
    ([*URLS, "--api-key-env", "A,B,C"], "--api-key-env must be NAME or CONTROL_NAME,CANDIDATE_NAME"),
    ([*URLS, "--draft-kv", "sharded"], "--draft-kv: an attached server's build decides draft-KV replication"),
])
def test_refused_attach_options_are_exit_2_in_one_line(qual, tmp_path, args, needle):
    proc = qual(*args, "--out", tmp_path / "o", "--history", tmp_path / "h.sqlite")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines
    assert not (tmp_path / "o").exists() and not (tmp_path / "h.sqlite").exists()


def test_an_unreachable_server_is_exit_3_before_anything_is_written(qual, tmp_path):
    port = free_port()  # nothing listens there
    proc = qual("--control-url", f"http://127.0.0.1:{port}", "--candidate-url", f"http://127.0.0.1:{port}",
                "--out", tmp_path / "o", "--history", tmp_path / "h.sqlite")
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"control server http://127.0.0.1:{port} is unreachable" in lines[0], lines
    assert not (tmp_path / "o").exists()


def test_dry_run_names_both_servers_and_contacts_neither(qual, tmp_path):
    proc = qual(*URLS, "--api-key-env", "KEY", "--dry-run", "--out", tmp_path / "o")
    assert proc.returncode == 0, proc.stderr
    assert "control: attach to http://127.0.0.1:9 (expects DCP 1" in proc.stdout
    assert "candidate: attach to http://127.0.0.1:9 (expects DCP 4" in proc.stdout and "API key from $KEY" in proc.stdout
