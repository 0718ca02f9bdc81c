"""HTTP to a vLLM server: each call under one deadline and a size cap, never redirected to another origin.

urllib does the protocol (and the environment's proxies still apply); on its own its timeout bounds each socket read,
not a call (a server sending a byte a second never times out), it reads a reply whole however long it is, and it
follows a redirect anywhere with every header, the API key included. Here a call has a deadline from its connect to
its reply's last byte (a timer shuts the connection's socket when it passes; the handshake has a shorter one of its
own), a reply larger than its cap is not read further, and a redirect is followed only within the origin (scheme,
host, port). Whatever a server sends that qual shows is one line, escaped and bounded (`one_line`).
"""

from __future__ import annotations

import http.client
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Callable
from urllib.parse import urljoin, urlsplit

from qual.errors import QualError
from qual.redact import REDACTED, redact_text, redact_url
from qual.userfiles import load_json
from qual.validation import ascii_digits

MiB = 1 << 20
MAX_REDIRECTS = 5
ERROR_BODY_BYTES = 64 << 10  # read of an error reply: its message is shown in one line
SHOWN_CHARS = 200  # of server-sent text in a message
MAX_WAIT_S = 7 * 86400.0  # a longer timeout is this (a timer or socket timeout of 1e300 s overflows)
_CHUNK = 64 << 10
REDIRECTS = (301, 302, 303, 307, 308)  # statuses with a Location qual may follow


class ClientError(Exception):
    """The server refused or failed a call: an HTTP error, no connection, a deadline, an oversized reply, a redirect
    away, a reply that is not what was asked for."""

    def __init__(self, message: str, status: int | None = None, reached: bool = False):
        super().__init__(message)
        self.status = status  # the HTTP status where the server answered; None where it did not
        self.reached = reached  # the server answered something (a status line)


def one_line(text: str, limit: int = SHOWN_CHARS) -> str:
    """Text a server sent, as a message shows it: one line, control characters escaped, secret shapes redacted, at
    most `limit` characters."""
    text = " ".join(redact_text(text).split())
    text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
    return text if len(text) <= limit else text[:limit] + "..."


def origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        port = None
    return scheme, (parts.hostname or "").lower(), port or {"http": 80, "https": 443}.get(scheme)


class _Deadline:
    """One call's deadline: bounds each connect, then each read, and shuts the open connection down when it passes
    (a server dribbling bytes never lets a per-read timeout expire)."""

    def __init__(self, seconds: float, connect_s: float):
        self.seconds, self.connect_s = min(seconds, MAX_WAIT_S), min(connect_s, MAX_WAIT_S)
        self.end = time.monotonic() + self.seconds
        self.fired = False
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(self.seconds, self._fire)
        self._timer.daemon = True

    def remaining(self) -> float:
        return self.end - time.monotonic()

    @property
    def passed(self) -> bool:
        return self.fired or self.remaining() <= 0

    def track(self, sock: socket.socket) -> None:
        """A connected socket (urllib detaches it from its connection once the reply's headers are read)."""
        with self._lock:
            self._socks.append(sock)
            fired = self.fired
        if fired:
            self._shut(sock)

    def _fire(self) -> None:
        with self._lock:
            self.fired = True
            socks = list(self._socks)
        for sock in socks:
            self._shut(sock)

    @staticmethod
    def _shut(sock: socket.socket) -> None:
        try:  # the plain socket's shutdown, also under TLS: a blocked read returns at once
            socket.socket.shutdown(sock, socket.SHUT_RDWR)
        except OSError:
            pass  # closed already

    def __enter__(self) -> "_Deadline":
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()


class _Bounded:
    """A connection whose handshake takes at most the connect timeout, and whose reads end with the call."""

    deadline: _Deadline

    def connect(self):
        left = self.deadline.remaining()
        if left <= 0:
            raise TimeoutError("the deadline passed before connecting")
        self.timeout = min(self.deadline.connect_s, left)
        try:
            super().connect()
        except TimeoutError:
            raise TimeoutError(f"no connection within {self.timeout:g} s") from None
        self.sock.settimeout(max(self.deadline.remaining(), 0.001))
        self.deadline.track(self.sock)


class _HTTPConnection(_Bounded, http.client.HTTPConnection):
    pass


class _HTTPSConnection(_Bounded, http.client.HTTPSConnection):
    pass


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def http_open(self, req):
        return self.do_open(self._connection, req)

    def _connection(self, host, **kwargs):
        conn = _HTTPConnection(host, **kwargs)
        conn.deadline = self.deadline
        return conn


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def https_open(self, req):
        return self.do_open(self._connection, req)

    def _connection(self, host, **kwargs):
        conn = _HTTPSConnection(host, **kwargs)
        conn.deadline = self.deadline
        return conn


def _opener(deadline: _Deadline) -> urllib.request.OpenerDirector:
    """urllib's opener without its redirect handler: a 3xx comes back as an HTTPError, and fetch decides."""
    opener = urllib.request.OpenerDirector()
    for handler in (urllib.request.ProxyHandler(), urllib.request.UnknownHandler(), _HTTPHandler(deadline),
                    _HTTPSHandler(deadline), urllib.request.HTTPDefaultErrorHandler(),
                    urllib.request.HTTPErrorProcessor()):
        opener.add_handler(handler)
    return opener


def fetch(url: str, *, data: bytes | None = None, headers: dict[str, str] | None = None, max_bytes: int,
          deadline_s: float, connect_s: float, deadline_name: str) -> bytes:
    """The body of a 2xx reply to GET url (POST where data is given), read within deadline_s from the first connect
    (connect_s for each handshake) and at most max_bytes long; ClientError otherwise. deadline_name names the
    setting in the message where the deadline passes."""
    return _call(url, data, headers, max_bytes, deadline_s, connect_s, deadline_name, _read)


def fetch_lines(url: str, on_line: Callable[[bytes, float], None], *, data: bytes | None = None,
                headers: dict[str, str] | None = None, max_bytes: int, deadline_s: float, connect_s: float,
                deadline_name: str) -> None:
    """fetch, handing on_line each line of the reply as it is read, with the time.perf_counter() then (a streamed
    reply's events as they come), under the same deadline and cap."""

    def read(resp, cap: int, url: str) -> None:
        too_large = _too_large(resp, cap, url)
        total = 0
        while line := resp.readline(cap + 1 - total):
            total += len(line)
            if total > cap:
                raise too_large
            on_line(line, time.perf_counter())

    _call(url, data, headers, max_bytes, deadline_s, connect_s, deadline_name, read)


def _call(url: str, data: bytes | None, headers: dict[str, str] | None, max_bytes: int, deadline_s: float,
          connect_s: float, deadline_name: str, read):
    headers = dict(headers or {})
    secrets = [v.split(" ", 1)[-1] for k, v in headers.items() if k.lower() == "authorization"]
    with _Deadline(deadline_s, connect_s) as deadline:
        opener = _opener(deadline)
        current = url
        for _ in range(MAX_REDIRECTS + 1):
            try:
                with opener.open(urllib.request.Request(current, data=data, headers=headers),
                                 timeout=max(deadline.remaining(), 0.001)) as resp:
                    body = read(resp, max_bytes, current)
                if deadline.fired:  # the socket was shut mid-reply: what came may end anywhere
                    raise _failed(current, None, deadline, deadline_name)
                return body
            except urllib.error.HTTPError as exc:
                with exc:
                    target = _redirect(exc, current, data)
                    if target is None:
                        raise ClientError(f"HTTP {exc.code} from {urlsplit(current).path}: "
                                          f"{_error_text(exc, secrets)}", exc.code, reached=True) from None
                current = target
            except urllib.error.URLError as exc:
                raise _failed(current, exc.reason, deadline, deadline_name) from None
            except (OSError, http.client.HTTPException) as exc:
                raise _failed(current, exc, deadline, deadline_name) from None
            except ValueError:  # a URL or header http.client refuses to send: its text would show the header
                raise ClientError(f"{redact_url(current)}: not sent (a control character in the URL or a header)") \
                    from None
    raise ClientError(f"{redact_url(url)}: more than {MAX_REDIRECTS} redirects", reached=True)


def _too_large(resp, max_bytes: int, url: str) -> ClientError:
    """The error of a reply longer than max_bytes, raised at once where the reply declares that length."""
    declared = resp.headers.get("Content-Length", "")
    too_large = ClientError(f"{redact_url(url)}: the reply is larger than {_size(max_bytes)}, qual's cap for "
                            f"{urlsplit(url).path}; not read further", reached=True)
    if ascii_digits(declared) and int(declared) > max_bytes:
        raise too_large
    return too_large


def _read(resp, max_bytes: int, url: str) -> bytes:
    """The reply's body, or ClientError where it is longer than max_bytes (declared or as sent)."""
    too_large = _too_large(resp, max_bytes, url)
    chunks, total = [], 0
    while chunk := resp.read(min(_CHUNK, max_bytes + 1 - total)):
        total += len(chunk)
        if total > max_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n % MiB == 0 else f"{n} bytes"


def _redirect(exc: urllib.error.HTTPError, current: str, data: bytes | None) -> str | None:
    """Where a redirect leads, if qual follows it (same origin, same method); None for an error that is no redirect;
    ClientError for one that is not followed."""
    location = exc.headers.get("Location") if exc.code in REDIRECTS else None
    if location is None:
        return None
    target = urljoin(current, location)
    shown = f"{redact_url(current)} redirected (HTTP {exc.code}) to {one_line(redact_url(target))}"
    if origin(target) != origin(current):
        raise ClientError(f"{shown}: another origin, not followed (the API key is not sent there); give that URL if it "
                          "is the server", exc.code, reached=True)
    if data is not None and exc.code not in (307, 308):
        raise ClientError(f"{shown}, which would turn a POST into a GET: not followed", exc.code, reached=True)
    return target


def _error_text(exc: urllib.error.HTTPError, secrets: list[str]) -> str:
    """An error reply's message in one line: vLLM's JSON `message` where there is one, else the body's text."""
    try:
        body = exc.read(ERROR_BODY_BYTES)
    except (OSError, http.client.HTTPException):
        body = b""
    text = body.decode("utf-8", errors="replace")
    try:
        parsed = load_json(text, "error reply")
    except QualError:
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error")
        message = error.get("message") if isinstance(error, dict) else parsed.get("message")
        if isinstance(message, str):
            text = message
    elif "html" in (exc.headers.get("Content-Type") or "").lower():
        text = re.sub(r"<[^>]*>", " ", text)
    for secret in filter(None, secrets):  # a server echoing the request's headers back
        text = text.replace(secret, REDACTED)
    return one_line(text) or "(no body)"


def _failed(url: str, reason, deadline: _Deadline, deadline_name: str) -> ClientError:
    if deadline.passed:
        return ClientError(f"{redact_url(url)}: no whole reply within {deadline.seconds:g} s ({deadline_name})")
    return ClientError(f"{redact_url(url)}: {one_line(str(reason)) or type(reason).__name__}")
