"""A minimal Chrome DevTools Protocol client over `chromium --remote-debugging-pipe`, for the report's layout tests.

The command-line modes cannot do what those tests need: `--dump-dom` lays a page out in a window at least 500 px
wide whatever --window-size says, and `--screenshot` returns pixels, not numbers. Over the pipe, one page is laid
out at an exact size (Emulation.setDeviceMetricsOverride), measured by a script (Runtime.evaluate, which the page's
Content-Security-Policy does not govern) and captured as a PNG, all from the same layout.

The pipe is Chromium's: it reads commands on fd 3 and writes replies on fd 4, each a JSON text ended by a NUL byte.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import subprocess
import time
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


class DevToolsError(RuntimeError):
    pass


def _pipe_above_4() -> tuple[int, int]:
    """A close-on-exec pipe whose ends are above 4, so that moving them to 3 and 4 never overwrites one of them."""
    ends = []
    for fd in os.pipe():
        ends.append(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10))
        os.close(fd)
    return ends[0], ends[1]


class Browser:
    """One headless Chromium; `with Browser(path, profile) as b: b.open(...)`."""

    def __init__(self, chromium: str, profile: Path, timeout: float = 60.0):
        self.timeout = timeout
        to_child, self._out = _pipe_above_4()  # we write commands; Chromium reads them on fd 3
        self._in, from_child = _pipe_above_4()  # Chromium writes replies on fd 4

        def fds() -> None:  # in the child, before exec: the pipe ends at the numbers Chromium expects
            os.dup2(to_child, 3)
            os.dup2(from_child, 4)

        self.proc = subprocess.Popen([chromium, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-pipe",
                                      "about:blank"], preexec_fn=fds, pass_fds=(3, 4),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_child)
        os.close(from_child)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict] = []

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.send("Browser.close")
        except (DevToolsError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._out)
        os.close(self._in)

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._in], [], [], left)[0]:
                raise DevToolsError("Chromium did not answer in time")
            chunk = os.read(self._in, 1 << 20)
            if not chunk:
                raise DevToolsError(f"Chromium closed the pipe (exit {self.proc.poll()})")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        """Send one command and return its result (events that arrive meanwhile are kept in self.events)."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise DevToolsError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str, session: str) -> dict:
        deadline = time.monotonic() + self.timeout
        while True:
            for i, event in enumerate(self.events):
                if event.get("method") == method and event.get("sessionId") == session:
                    return self.events.pop(i)
            self.events.append(self._read_message(deadline))

    def open(self, url: str, width: int, height: int) -> "Page":
        """A new tab laid out at width x CSS pixels (scale 1), url loaded."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session)
        self.send("Page.enable", session=session)
        self.send("Page.navigate", {"url": url}, session)
        self.wait_for("Page.loadEventFired", session)
        return Page(self, session)


class Page:
    def __init__(self, browser: Browser, session: str):
        self.browser, self.session = browser, session

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (JSON-serialisable)."""
        result = self.browser.send("Runtime.evaluate", {"expression": expression, "returnByValue": True},
                                   self.session)
        if "exceptionDetails" in result:
            raise DevToolsError(f"script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, png: Path, full_page: bool = False) -> Path:
        """The viewport (or the whole page, at the viewport's width) as a PNG."""
        params: dict = {"format": "png"}
        if full_page:
            width, height = self.evaluate("[document.documentElement.clientWidth, "
                                          "document.documentElement.scrollHeight]")
            params.update(captureBeyondViewport=True,
                          clip={"x": 0, "y": 0, "width": width, "height": height, "scale": 1})
        data = self.browser.send("Page.captureScreenshot", params, self.session)["data"]
        png.write_bytes(base64.b64decode(data))
        return png
