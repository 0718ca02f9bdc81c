"""Attach mode against hostile servers: real HTTP servers this module starts on 127.0.0.1, in threads.

Each case is a reproduction of issue 34's attach items (a redirect to another origin, an endless body, a server that
sends one byte a second, one that never answers the connect handshake, CR/LF in a URL or a key, a password in a URL,
raw error bodies) and the `--dry-run` redaction weak spot. Each asserts the exit code, the one line on stderr, that
the key (or password) appears in nothing qual printed or wrote, and the time bound where one is named.

`FakeVllm` answers like an attached vLLM 0.32 server with per-request spec-decode metrics, enough for a whole run
of the toy profile; a `hostile` hook takes over the requests a case is about.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import xml.etree.ElementTree as ET
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from qual.paths import DATA_DIR
from qual.tokenize import PromptTokenizer

TOY = DATA_DIR / "models" / "toy"
K = 7  # the toy profile's num_speculative_tokens


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # one request a connection: a hostile reply ends with its connection

    def do_GET(self):
        self.server.owner.answer(self, "GET")

    def do_POST(self):
        self.server.owner.answer(self, "POST")

    def log_message(self, *args):
        pass


class Local:
    """An HTTP server on 127.0.0.1 in a daemon thread; `respond(handler, method, path, body)` answers each request.

    Every request's method, path and Authorization header is kept in `seen`."""

    def __init__(self, respond):
        self.respond = respond
        self.seen: list[tuple[str, str, str | None]] = []
        self.stop = threading.Event()  # set at close: a dribbling or endless writer ends
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.owner = self
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def answer(self, h: BaseHTTPRequestHandler, method: str) -> None:
        body = h.rfile.read(int(h.headers.get("Content-Length") or 0)) if method == "POST" else b""
        self.seen.append((method, h.path, h.headers.get("Authorization")))
        try:
            self.respond(h, method, h.path, body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client hung up: what a bounded reader does to an endless or slow reply

    def close(self) -> None:
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def send(h: BaseHTTPRequestHandler, status: int, body: bytes | str | dict, content_type: str = "application/json",
         headers: dict | None = None) -> None:
    data = json.dumps(body).encode() if isinstance(body, dict) else body.encode() if isinstance(body, str) else body
    h.send_response(status)
    h.send_header("Content-Type", content_type)
    h.send_header("Content-Length", str(len(data)))
    for name, value in (headers or {}).items():
        h.send_header(name, value)
    h.end_headers()
    h.wfile.write(data)


def endless(h: BaseHTTPRequestHandler, stop: threading.Event) -> None:
    """200 and a body that never ends (no Content-Length): 1 MiB writes until the client hangs up."""
    h.send_response(200)
    h.send_header("Content-Type", "application/json")
    h.end_headers()
    chunk = b"[" * (1 << 20)
    while not stop.is_set():
        h.wfile.write(chunk)


def dribble(h: BaseHTTPRequestHandler, stop: threading.Event, in_headers: bool = False) -> None:
    """200, a Content-Length it will never reach, then one byte a second (of the body, or of a header's value)."""
    if in_headers:
        h.wfile.write(b"HTTP/1.0 200 OK\r\nX-Slow: ")
    else:
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", "1000000")
        h.end_headers()
        h.wfile.write(b"{")
    h.wfile.flush()
    while not stop.wait(1.0):
        h.wfile.write(b" ")
        h.wfile.flush()


class FakeVllm:
    """Answers as an attached vLLM 0.32 server serving the toy pair with per-request spec-decode metrics.

    A completion of n tokens drafts n // 2 times and accepts one token in all but the steps needed to end at n
    (records that every engine's checks accept). `hostile(h, method, path, body, requests)` may answer a request
    itself (returning True); `requests` counts the corpus requests so far (completions of more than the one token
    of qual's probe), so 2 is the control arm's second."""

    def __init__(self, hostile=None):
        self.tokenizer = PromptTokenizer(str(TOY / "target"))
        self.hostile = hostile
        self.requests = 0
        self.served = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [0] * K}  # what /metrics counts
        self.server = Local(self)

    @property
    def url(self) -> str:
        return self.server.url

    def __call__(self, h, method: str, path: str, body: bytes) -> None:
        if path == "/v1/completions" and json.loads(body)["max_tokens"] > 1:
            self.requests += 1
        if self.hostile is not None and self.hostile(h, method, path, body, self.requests):
            return
        if path == "/v1/models":
            send(h, 200, {"object": "list", "data": [{"id": "toy", "root": "toy", "max_model_len": 2048}]})
        elif path == "/version":
            send(h, 200, {"version": "0.32.0"})
        elif path == "/health":
            send(h, 200, "", "text/plain")
        elif path == "/metrics":
            send(h, 200, self._metrics(), "text/plain")
        elif path == "/tokenize":
            send(h, 200, {"tokens": self.tokenizer.encode(json.loads(body)["prompt"]), "max_model_len": 2048})
        elif path == "/v1/completions":
            reply = self._completion(json.loads(body))
            self._count(reply["metrics"]["speculative_decoding"])  # before the reply: its counters are there at once
            send(h, 200, reply)
        else:
            send(h, 404, {"object": "error", "message": f"Not Found: {path}"})

    def _count(self, spec: dict) -> None:
        hist, c = spec["acceptance_histogram"], self.served
        c["drafts"] += spec["num_spec_steps"]
        c["draft_tokens"] += spec["num_draft_tokens"]
        c["accepted"] += spec["num_accepted_draft_tokens"]
        for i in range(K):
            c["per_pos"][i] += sum(hist[i + 1:])

    def _metrics(self) -> str:
        """vLLM's cumulative spec-decode counters, in its Prometheus names and labels."""
        c, labels = self.served, 'engine="0",model_name="toy"'
        lines = [f"vllm:spec_decode_num_drafts_total{{{labels}}} {c['drafts']}.0",
                 f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {c['draft_tokens']}.0",
                 f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {c['accepted']}.0"]
        lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{i}"}} {n}.0'
                  for i, n in enumerate(c["per_pos"])]
        return "\n".join(lines) + "\n"

    @staticmethod
    def _completion(req: dict) -> dict:
        n = req["max_tokens"]
        steps = n // 2
        accepted = n - 1 - steps  # the prefill's token, then accepted + 1 a step
        histogram = [steps - accepted, accepted] + [0] * (K - 1)
        spec = {"num_spec_tokens": K, "num_spec_steps": steps, "num_draft_tokens": steps * K,
                "num_accepted_draft_tokens": accepted, "acceptance_histogram": histogram}
        return {"id": "cmpl-0", "object": "text_completion", "model": "toy", "system_fingerprint": "vllm-0.32.0-nohash",
                "choices": [{"index": 0, "text": "", "token_ids": [(i % 97) + 1 for i in range(n)],
                             "prompt_token_ids": req["prompt"], "finish_reason": "length"}],
                "metrics": {"speculative_decoding": spec}}

    def close(self) -> None:
        self.server.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Silent:
    """A listening socket on 127.0.0.1 that never accepts. full=True first fills its accept queue, so that a new
    connection's handshake is never answered (Linux drops the SYN); else the kernel completes it and nothing is said."""

    def __init__(self, full: bool):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.fillers = []
        if full:
            for _ in range(2):  # a backlog of 0 still queues one connection
                c = socket.socket()
                c.setblocking(False)
                c.connect_ex(self.sock.getsockname())
                self.fillers.append(c)
            time.sleep(0.2)


    def close(self) -> None:
        for c in self.fillers:
            c.close()
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# -- running qual ---------------------------------------------------------------------------------------------------

import resource  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402

from qual.paths import shipped  # noqa: E402

KEY_ENV = "QUAL_TEST_ATTACH_KEY"
KEY = "qk-" + "7f3a9c1e5b" * 3  # the API key: it must appear in nothing qual prints or writes
LIMIT = 3
MAX_TOKENS = 8


@pytest.fixture
def qual(capsys, monkeypatch, tmp_path):
    """`qual run ARGS` through the console entry point, in this process, timed; --out and --history in tmp_path,
    temporary files (a crash file's fallback) in tmp_path/tmp, the key in KEY_ENV; `lines`: stderr after the run's
    progress lines."""
    from qual.cli.main import main

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setenv(KEY_ENV, KEY)

    def call(*args, out: bool = True):
        where = ["--out", tmp_path / "o", "--history", tmp_path / "h.sqlite"] if out else []
        argv, handlers = sys.argv, {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        sys.argv = ["qual", "run", *map(str, [*args, *where])]
        t0 = time.monotonic()
        try:
            main()
            code = 0
        except SystemExit as exc:
            code = exc.code
        finally:
            seconds = time.monotonic() - t0
            sys.argv = argv
            for s, h in handlers.items():
                signal.signal(s, h)  # main() installs its own
        got = capsys.readouterr()
        err = got.err.strip().splitlines()
        progress = [ln for ln in err if ln.startswith("progress: ")]  # where the arms started: before any message
        assert err[:len(progress)] == progress, err
        lines = err[len(progress):]
        return SimpleNamespace(returncode=code, stdout=got.out, stderr=got.err, seconds=seconds,
                               line=lines[-1] if lines else "", lines=lines)

    return call


def attach(control: str, candidate: str | None = None, *more) -> list[str]:
    return ["--control-url", control, "--candidate-url", candidate or control, "--api-key-env", KEY_ENV,
            "--limit", str(LIMIT), "--max-tokens", str(MAX_TOKENS), *more]


def profile(tmp_path: Path, **attach_settings) -> str:
    """The toy profile with an `attach:` section."""
    path = tmp_path / "toy-attach.yaml"
    section = "".join(f"  {k}: {v}\n" for k, v in attach_settings.items())
    path.write_text(shipped("profile", "toy").read_text() + (f"attach:\n{section}" if section else ""))
    return str(path)


def nowhere(tmp_path: Path, *secrets: str, printed: str = "") -> None:
    """No secret in what was printed nor in any file under tmp_path (run directory, history, crash files)."""
    for secret in secrets:
        assert secret not in printed
        for f in tmp_path.rglob("*"):
            if f.is_file():
                assert secret.encode() not in f.read_bytes(), f"{secret!r} written to {f}"


def nothing_written(tmp_path: Path) -> None:
    assert not (tmp_path / "o").exists() and not (tmp_path / "h.sqlite").exists()
    assert list((tmp_path / "tmp").iterdir()) == []  # no crash file


def journal(tmp_path: Path, arm: str) -> list[dict]:
    path = tmp_path / "o" / f"{arm}.requests.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# -- a well-behaved server: the fake is faithful enough for a whole run -------------------------------------------------

def test_a_whole_run_against_the_fake_server_passes_and_records_its_deadlines(qual, tmp_path):
    with FakeVllm() as server:
        proc = qual("--model", profile(tmp_path, request_timeout_s=30), *attach(server.url))
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "o" / "result.json").read_text())
    for arm in ("control", "candidate"):
        settings = result["arms"][arm]["config"]["extra"]["attach"]
        assert settings == {"served_model_name": "toy", "request_timeout_s": 30.0, "connect_timeout_s": 10.0,
                            "server_version": "0.32.0"}  # the server's /version: part of the configuration key
        assert result["arms"][arm]["engine_version"] == "vllm 0.32.0 (attached)"
        assert len(result["arms"][arm]["per_request"]) == LIMIT
    assert {auth for _, _, auth in server.server.seen} == {f"Bearer {KEY}"}
    nowhere(tmp_path, KEY, printed=proc.stdout + proc.stderr)


@pytest.mark.parametrize("version, refused", [("0.31.2", True), ("0.32.0rc1", True), ("0.32.0.dev41", True),
                                               ("0.33.0.dev41", False), ("a build of our own", False)])
def test_a_server_older_than_the_first_vllm_qual_drives_is_refused_by_its_version(qual, tmp_path, version, refused):
    """An attached server is held to the release a started one is (qual.inventory.too_old, PEP 440's order): an older
    one is exit 2 before any request of the run, naming its version; an unreadable version runs, recorded as it is."""
    def reports(h, method, path, body, requests):
        if path == "/version":
            send(h, 200, {"version": version})
            return True
        return False

    with FakeVllm(reports) as server:
        proc = qual(*attach(server.url))
    if refused:
        assert proc.returncode == 2, proc.stderr
        assert len(proc.lines) == 1
        assert f"reports vLLM {version}, older than 0.32, the first release with DFlash and DCP qual drives" in proc.line
        assert server.requests == 0
        nothing_written(tmp_path)
    else:
        assert proc.returncode == 0, proc.stderr


# -- 5. redirects ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("userinfo", ["", "user:hunter2@"])
def test_a_redirect_to_another_origin_is_not_followed_and_says_where(qual, tmp_path, userinfo):
    """Issue 34 #5: the key went to the address a redirect named. Now nothing reaches it: exit 2, naming both URLs
    (a password in the Location redacted)."""
    with FakeVllm() as elsewhere, Local(lambda h, m, path, b: send(
            h, 307, "", headers={"Location": elsewhere.url.replace("//", f"//{userinfo}") + path})) as redirecting:
        proc = qual(*attach(redirecting.url))
    assert proc.returncode == 2, proc.stderr
    assert len(proc.lines) == 1
    assert (f"{redirecting.url}/v1/models redirected (HTTP 307) to "
            f"{elsewhere.url.replace('//', '//<redacted>@' if userinfo else '//')}/v1/models: another origin, not "
            "followed (the API key is not sent there)") in proc.line
    assert elsewhere.server.seen == []  # neither the key nor anything else went there
    nowhere(tmp_path, KEY, "hunter2", printed=proc.stdout + proc.stderr)
    nothing_written(tmp_path)


def test_a_redirect_within_the_origin_is_followed_with_the_key(qual, tmp_path):
    """A proxy path that redirects (308) into the server's own root: every call, POSTs included, arrives."""
    def moved(h, method, path, body, requests):
        if path.startswith("/old/"):
            send(h, 308, "", headers={"Location": path.removeprefix("/old")})
            return True
        return False

    with FakeVllm(moved) as server:
        proc = qual(*attach(server.url + "/old"))
    assert proc.returncode == 0, proc.stderr
    assert ("POST", "/v1/completions", f"Bearer {KEY}") in server.server.seen


# -- 6. endless bodies --------------------------------------------------------------------------------------------------

def test_an_endless_reply_while_attaching_is_exit_3_naming_the_url(qual, tmp_path):
    """Issue 34 #6: MemoryError (exit 4). Now the reply is read up to its endpoint's cap."""
    with Local(lambda h, m, p, b: endless(h, server.stop)) as server:
        proc = qual(*attach(server.url))
    assert proc.returncode == 3, proc.stderr
    assert len(proc.lines) == 1 and proc.line.startswith("engine failure: ")
    assert f"{server.url}/v1/models: the reply is larger than 4 MiB, qual's cap for /v1/models" in proc.line
    assert proc.seconds < 15
    nowhere(tmp_path, KEY, printed=proc.stderr)
    nothing_written(tmp_path)


def test_an_endless_completion_mid_run_is_exit_3_and_keeps_what_finished(qual, tmp_path):
    """The same for a completion of the run (cap 64 MiB): exit 3 with the resume hint, the first request journaled,
    memory not grown by more than a few caps."""
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with FakeVllm(lambda h, m, path, b, n: n == 2 and path == "/v1/completions" and (endless(h, server.server.stop) or True)) as server:
        proc = qual(*attach(server.url))
    assert proc.returncode == 3, proc.stderr
    assert len(proc.lines) == 1
    assert f"{server.url}/v1/completions: the reply is larger than 64 MiB, qual's cap for /v1/completions" in proc.line
    assert f"qual run --resume {tmp_path / 'o'}" in proc.line
    assert len(journal(tmp_path, "control")) == 1
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 512 * 1024  # KiB
    nowhere(tmp_path, KEY, printed=proc.stderr)


def test_a_server_gone_between_a_reply_and_its_counters_is_exit_3_with_the_resume_hint(qual, tmp_path):
    """--exclusive reads /metrics after each reply: a server that goes away between the reply and that read (/metrics
    and /health answered by a closed connection) went away, with the finished requests kept and the resume hint,
    as one gone during a request; not an unreadable /metrics. The reply carried its own counts: it is kept too."""
    def gone(h, method, path, body, requests):
        if requests >= 2 and path in ("/metrics", "/health"):
            h.close_connection = True  # no reply: the connection closes
            return True
        return False

    with FakeVllm(gone) as server:
        proc = qual(*attach(server.url, None, "--exclusive"))
    assert proc.returncode == 3, proc.stderr
    assert len(proc.lines) == 1
    assert f"control server {server.url} went away after request HumanEval/1 (" in proc.line, proc.line
    assert f"2 finished requests of this arm kept: `qual run --resume {tmp_path / 'o'}`" in proc.line
    assert len(journal(tmp_path, "control")) == 2
    nowhere(tmp_path, KEY, printed=proc.stderr)


# -- 7. slow senders ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("in_headers", [False, True], ids=["body", "headers"])
def test_a_slow_sender_while_attaching_meets_the_connect_deadline(qual, tmp_path, in_headers):
    """Issue 34 #7: one byte a second held qual forever (the timeout was per socket read)."""
    with Local(lambda h, m, p, b: dribble(h, server.stop, in_headers)) as server:
        proc = qual("--model", profile(tmp_path, connect_timeout_s=1.5), *attach(server.url))
    assert proc.returncode == 3, proc.stderr
    assert len(proc.lines) == 1
    assert (f"{server.url}/v1/models: no whole reply within 1.5 s (the profile's attach.connect_timeout_s)"
            in proc.line)
    assert proc.seconds < 1.5 + 3
    nothing_written(tmp_path)


def test_a_slow_sender_mid_run_meets_the_request_deadline_and_resume_finishes(qual, tmp_path):
    """A completion dribbled one byte a second: exit 3 when attach.request_timeout_s passes, with the resume hint;
    the resumed run, against the server behaving again, finishes with every request and records the deadline."""
    began = []

    def slow(h, method, path, body, requests):
        if requests == 2 and path == "/v1/completions" and not began:  # the control arm's second request
            began.append(time.monotonic())
            dribble(h, server.server.stop)
            return True
        return False

    with FakeVllm(slow) as server:
        model = profile(tmp_path, request_timeout_s=2)
        proc = qual("--model", model, *attach(server.url))
        failed_after = time.monotonic() - began[0] if began else None
        assert proc.returncode == 3, proc.stderr
        assert len(proc.lines) == 1
        assert (f"control server {server.url} failed during request HumanEval/1 ({server.url}/v1/completions: no "
                "whole reply within 2 s (the profile's attach.request_timeout_s)); 1 finished request of this arm "
                f"kept: `qual run --resume {tmp_path / 'o'}` finishes the run once the server answers") in proc.line
        assert failed_after is not None and failed_after < 2 + 2
        assert len(journal(tmp_path, "control")) == 1
        resumed = qual("--resume", tmp_path / "o", out=False)
    assert resumed.returncode == 0, resumed.stderr
    result = json.loads((tmp_path / "o" / "result.json").read_text())
    assert [len(result["arms"][arm]["per_request"]) for arm in ("control", "candidate")] == [LIMIT, LIMIT]
    assert result["arms"]["control"]["config"]["extra"]["attach"]["request_timeout_s"] == 2.0
    nowhere(tmp_path, KEY, printed=proc.stderr + resumed.stdout + resumed.stderr)


# -- 10. a silent server --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("full,setting,bound", [(False, None, 10.0), (True, 1.0, 1.0)],
                         ids=["accepted-never-answered-default", "handshake-never-completed"])
def test_a_silent_server_fails_at_the_connect_deadline(qual, tmp_path, full, setting, bound):
    """Issue 34 #10: 62.5 s to fail (a 60 s timeout per read). Now attach.connect_timeout_s, 10 s by default, bounds
    each call while attaching, and each handshake."""
    model = profile(tmp_path, connect_timeout_s=setting) if setting else "toy"
    with Silent(full) as server:
        proc = qual("--model", model, *attach(server.url))
    assert proc.returncode == 3, proc.stderr
    assert len(proc.lines) == 1
    assert (f"control server {server.url} is unreachable (attaching): {server.url}/v1/models: no whole reply within "
            f"{bound:g} s (the profile's attach.connect_timeout_s)") in proc.line
    assert bound - 0.5 < proc.seconds < bound + 3
    nothing_written(tmp_path)


# -- 8. CR/LF in a URL or a key ------------------------------------------------------------------------------------

def test_a_line_break_in_the_url_is_exit_2_before_any_contact(qual, tmp_path):
    """Issue 34 #8: exit 4, the key in the crash file. Now refused up front, naming the flag."""
    with FakeVllm() as server:
        proc = qual(*attach(server.url + "/\r\nX-Injected: 1", server.url))
        assert server.server.seen == []
    assert proc.returncode == 2, proc.stderr
    assert proc.lines == [f"error: --control-url '{server.url}/\\r\\nX-Injected: 1': a URL cannot hold a line break "
                          "(a request line or header would carry it)"]
    nowhere(tmp_path, KEY, printed=proc.stderr)
    nothing_written(tmp_path)


@pytest.mark.parametrize("key,what", [(KEY + "\r\nX-Injected: 1", "a line break"), (KEY + "\n", "a line break"),
                                      (KEY + "\x1b", "a control character"), (KEY + "é", "a character beyond ASCII"),
                                      (" " + KEY, "a leading or trailing space")],
                         ids=["crlf-header", "trailing-newline", "escape", "non-ascii", "leading-space"])
def test_a_key_no_header_can_carry_is_exit_2_and_never_shown(qual, tmp_path, monkeypatch, key, what):
    monkeypatch.setenv(KEY_ENV, key)
    with FakeVllm() as server:
        proc = qual(*attach(server.url))
        assert server.server.seen == []
    assert proc.returncode == 2, proc.stderr
    assert len(proc.lines) == 1
    assert proc.line.startswith(f"error: --api-key-env {KEY_ENV}: the key holds {what} (character ")
    assert proc.line.endswith("which an HTTP header cannot carry as it is; the key is not shown")
    nowhere(tmp_path, KEY, printed=proc.stderr)
    nothing_written(tmp_path)


# -- 9. a password in a URL --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dry_run", [False, True])
def test_a_password_in_the_url_is_refused_and_never_shown(qual, tmp_path, dry_run):
    """Issue 34 #9: printed on stderr. Userinfo is refused (vLLM takes a bearer key, --api-key-env), shown redacted,
    and nothing is contacted or written."""
    with FakeVllm() as server:
        url = server.url.replace("//", "//admin:hunter2@")
        proc = qual(*attach(url, server.url), *(["--dry-run"] if dry_run else []))
        assert server.server.seen == []
    assert proc.returncode == 2, proc.stderr
    assert proc.lines == [f"error: --control-url {server.url.replace('//', '//<redacted>@')}: credentials in a URL "
                          "would be shown and stored with it; the servers' key goes in an environment variable named "
                          "by --api-key-env"]
    nowhere(tmp_path, "hunter2", "admin", KEY, printed=proc.stdout + proc.stderr)
    nothing_written(tmp_path)


# -- 10. error bodies ---------------------------------------------------------------------------------------------

HTML = "\x1b[31mboom\x1b[0m\n<html>\n<head><title>502 Bad Gateway</title></head>\n<body>\n" + "<p>line</p>\n" * 200


def test_an_error_body_is_shown_in_one_escaped_bounded_line(qual, tmp_path):
    """Issue 34 #10: ANSI escapes and multi-line HTML reached the terminal raw. Now: one line, escaped, tags gone,
    at most 200 characters of it; a server echoing the request's Authorization header back shows no key."""
    def bad_gateway(h, method, path, body):
        send(h, 502, HTML + f"<pre>{h.headers.get('Authorization')}</pre>", "text/html")

    with Local(bad_gateway) as server:
        proc = qual(*attach(server.url))
    assert proc.returncode == 3, proc.stderr
    assert len(proc.lines) == 1 and "\x1b" not in proc.stderr
    assert (f"control server {server.url} failed (attaching): HTTP 502 from /v1/models: \\x1b[31mboom\\x1b[0m "
            "502 Bad Gateway line line") in proc.line
    assert proc.line.endswith("...") and len(proc.line) < 400
    nowhere(tmp_path, KEY, printed=proc.stderr)
    nothing_written(tmp_path)


def test_a_vllm_error_mid_run_shows_its_message(qual, tmp_path):
    """vLLM's JSON error: its message, not the JSON, in the one line (with the resume hint)."""
    def refuse(h, method, path, body, requests):
        if requests == 2 and path == "/v1/completions":
            send(h, 400, {"error": {"message": "This model's maximum context length is 2048 tokens.\n\x1b[2J",
                                    "type": "BadRequestError", "code": 400}})
            return True
        return False

    with FakeVllm(refuse) as server:
        proc = qual(*attach(server.url))
    assert proc.returncode == 3, proc.stderr
    assert len(proc.lines) == 1
    assert ("(HTTP 400 from /v1/completions: This model's maximum context length is 2048 tokens. \\x1b[2J); 1 finished "
            "request of this arm kept") in proc.line


def test_an_engine_failure_mid_run_leaves_a_junit_error_naming_it(qual, tmp_path):
    """Exit 3 inside the run directory: junit.xml holds one test case in error whose message is stderr's line (the
    server's message, a token it echoed redacted), so a CI job publishing JUnit shows why there is no verdict."""
    token = "hf_" + "AbCdEfGhIjKlMnOpQrSt"

    def refuse(h, method, path, body, requests):
        if requests == 2 and path == "/v1/completions":
            send(h, 500, {"error": {"message": f"worker died holding {token}", "type": "InternalServerError"}})
            return True
        return False

    with FakeVllm(refuse) as server:
        proc = qual(*attach(server.url))
    assert proc.returncode == 3, proc.stderr
    root = ET.parse(tmp_path / "o" / "junit.xml").getroot()
    assert (root.get("tests"), root.get("errors"), root.get("failures")) == ("1", "1", "0")
    [case] = root.iter("testcase")
    error = case.find("error")
    assert case.get("name") == "engine_failure" and error.get("type") == "EngineError"
    assert error.get("message") == proc.line and "worker died holding <redacted>" in proc.line
    assert case.get("classname") == "qual.gate.toy.dcp4"
    nowhere(tmp_path, KEY, token, printed=proc.stderr)


# -- the --dry-run weak spot: secrets by value shape --------------------------------------------------------------------

def test_dry_run_redacts_secret_names_and_secret_shaped_values(qual, tmp_path):
    """`MY_PASSWD` (a name the patterns missed) and `DATABASE_URL` with a password (a name no pattern can catch) were
    printed by `--dry-run`; now by name and by the value's shape."""
    path = tmp_path / "p.yaml"
    path.write_text(shipped("profile", "toy").read_text() + "  env:\n"
                    "    MY_PASSWD: hunter2\n"
                    "    DATABASE_URL: postgres://app:s3cret@db:5432/x\n"
                    "    EXTRA_ARGS: \"--header 'Authorization: Bearer opaque-value-1'\"\n"
                    "    UPLOAD_TO: hf_AbCdEfGhIjKlMnOpQrSt\n"
                    "    OMP_NUM_THREADS: '2'\n")
    proc = qual("--model", path, "--engine", "vllm", "--dcp", "1", "--limit", "1", "--dry-run", out=False)
    assert proc.returncode == 0, proc.stderr
    assert "MY_PASSWD='<redacted>'" in proc.stdout and "DATABASE_URL='postgres://<redacted>@db:5432/x'" in proc.stdout
    assert "UPLOAD_TO='<redacted>'" in proc.stdout and "OMP_NUM_THREADS=2" in proc.stdout
    for secret in ("hunter2", "s3cret", "app:", "opaque-value-1", "hf_AbCdEfGhIjKlMnOpQrSt"):
        assert secret not in proc.stdout + proc.stderr
