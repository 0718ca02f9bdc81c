"""Read a vLLM server log: why it failed (root cause, classified) and what it did about CUDA graphs."""

from __future__ import annotations

import re
from dataclasses import dataclass

from qual.records import GraphCapture

# "(Worker_TP0_DCP0 pid=123) ERROR 11-30 14:58:59 [multiproc_executor.py:1063] " and friends.
_PROC_PREFIX = re.compile(r"^\((?:[^()]*?) pid=\d+\)\s?")
_LOG_PREFIX = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\]\s?")
_ARGPARSE_ERROR = re.compile(r"^\S+(?: serve)?: error: (.+)$")
# An exception line as a traceback ends it: at column 0, a (dotted) class name then ": message".
_EXCEPTION = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Z]\w*(?:Error|Exception|Interrupt|Exit))(?::\s?(.*))?$")
# Wrappers that only point at the real cause ("See root cause above").
_WRAPPERS = (
    "Engine core initialization failed",
    "See root cause above",
    "Worker failed with error",
    "EngineCore encountered",
    "EngineCore failed to start",
    "Frontend process failed",
)
_OOM = re.compile(
    r"out of memory|OutOfMemoryError|KV cache is needed|No available memory for the cache blocks"
    r"|Cannot allocate memory|insufficient memory",
    re.IGNORECASE,
)
_CAPTURE = re.compile(r"capture_model|_capture_cudagraphs|cudagraph_utils|CUDA graph|cudaErrorStreamCapture|graph capture",
                      re.IGNORECASE)
ENGINE_INIT_FAILED = "Engine core initialization failed"

# Graph capture (format strings of vLLM 0.32: gpu_model_runner.py / gpu/model_runner.py / cudagraph_utils.py).
_CAPTURE_DONE = re.compile(r"Graph capturing finished in (\d+) secs, took (-?[\d.]+) GiB")
_CAPTURE_PROGRESS = re.compile(r"Capturing (?:[\w-]+ )*CUDA graphs \(([^)]*)\)")
_CONFIG_MODE = re.compile(r"'cudagraph_mode': <CUDAGraphMode\.(\w+)")
_CONFIG_SIZES = re.compile(r"'cudagraph_capture_sizes': \[([\d,\s]*)\]")
_DOWNGRADES = (
    re.compile(r"setting cudagraph_mode=(\w+)"),
    re.compile(r"Overriding cudagraph_mode (?:from )?\w+ to (\w+)"),
    re.compile(r"(Cudagraph is disabled under eager mode)"),
)


def strip_prefix(line: str) -> str:
    """A log line without vLLM's "(Proc pid=N) LEVEL date [file:line]" prefix."""
    line = _PROC_PREFIX.sub("", line, count=1)
    return _LOG_PREFIX.sub("", line, count=1)


@dataclass(frozen=True)
class FailureCause:
    """The line that explains a failure, and what kind of failure it is."""

    kind: str  # bad_flag | config_rejected | oom | graph_capture | engine_init | crash
    line: str
    lineno: int  # 1-based, in the log

    def __str__(self) -> str:
        return f"{self.kind}: {self.line} (log line {self.lineno})"


def _exception_lines(lines: list[str]) -> list[tuple[int, str]]:
    """(index, text) of traceback-ending exception lines, skipping "Exception ignored in" noise."""
    found, ignoring = [], False
    for i, raw in enumerate(lines):
        text = strip_prefix(raw).rstrip()
        if text.startswith("Exception ignored in"):
            ignoring = True  # finaliser noise (e.g. CPUDNNLGEMMHandler.__del__ on healthy CPU servers)
            continue
        if _EXCEPTION.match(text):
            if ignoring:
                ignoring = False
            else:
                found.append((i, text))
    return found


def _with_detail(lines: list[str], i: int, text: str) -> str:
    # pydantic puts the useful message on the indented line after "N validation error for X".
    if "ValidationError" in text and i + 1 < len(lines):
        detail = strip_prefix(lines[i + 1]).strip()
        detail = re.sub(r"\s*\[type=.*$", "", detail)
        return f"{text.split(': ', 1)[0]}: {detail}"
    return text


def classify_failure(log: str) -> FailureCause | None:
    """The root-cause line of a failed start or crash, classified; None if the log shows no error."""
    lines = log.splitlines()
    for i, raw in enumerate(lines):
        m = _ARGPARSE_ERROR.match(strip_prefix(raw).strip())
        if m:
            return FailureCause("bad_flag", m.group(0), i + 1)
    exceptions = _exception_lines(lines)
    if not exceptions:
        for i, raw in enumerate(lines):
            if ENGINE_INIT_FAILED in raw:
                return FailureCause("engine_init", strip_prefix(raw).strip(), i + 1)
        return None
    real = [(i, t) for i, t in exceptions if not any(w in t for w in _WRAPPERS)]
    i, text = (real or exceptions)[0]
    line = _with_detail(lines, i, text)
    if _OOM.search(line):
        kind = "oom"
    elif _CAPTURE.search(line) or any(_CAPTURE.search(strip_prefix(x)) for x in lines[max(0, i - 40) : i]):
        kind = "graph_capture"
    elif "ValidationError" in text:
        kind = "config_rejected"
    elif ENGINE_INIT_FAILED in log:
        kind = "engine_init"
    else:
        kind = "crash"
    return FailureCause(kind, line, i + 1)


def _effective_config(log: str) -> tuple[str | None, list[int] | None]:
    mode = _CONFIG_MODE.search(log)
    sizes = _CONFIG_SIZES.search(log)
    parsed = [int(s) for s in sizes.group(1).replace(",", " ").split()] if sizes else None
    return (mode.group(1) if mode else None), parsed


def parse_graph_capture(
    log: str, requested_mode: str | None, requested_sizes: list[int] | None, failure: FailureCause | None = None
) -> GraphCapture:
    """The capture record of one server: status, mode, sizes, time, memory, and any eager fallback."""
    requested_sizes = sorted(requested_sizes or [])
    effective_mode, effective_sizes = _effective_config(log)
    downgrade = None
    for line in log.splitlines():
        for pattern in _DOWNGRADES:
            m = pattern.search(line)
            if m:
                downgrade = strip_prefix(line).strip()
                effective_mode = "NONE" if "eager" in m.group(1) else m.group(1).upper()
    progress = sorted({m.group(1) for m in _CAPTURE_PROGRESS.finditer(log)})
    done = _CAPTURE_DONE.search(log)
    sizes = sorted(effective_sizes) if effective_sizes is not None else requested_sizes
    if effective_mode == "NONE":
        sizes = []

    if failure is not None and failure.kind == "graph_capture":
        status = "failed"
    elif done:
        status = "captured"
    else:
        status = "unsupported"

    wanted = requested_mode is not None and requested_mode.upper() != "NONE"
    fallback: list[int] = []
    if wanted and status != "captured":
        fallback = list(requested_sizes)  # asked for graphs, got none: every size runs eager
    elif wanted:
        fallback = [s for s in requested_sizes if s not in sizes]  # sizes vLLM dropped

    notes = []
    if downgrade:
        notes.append(f"vLLM changed the mode: {downgrade}")
    if progress:
        notes.append("captured: " + "; ".join(progress))
    if fallback:
        notes.append(f"requested {requested_mode} at {requested_sizes} but these sizes run eager: {fallback}")
    if status == "failed" and failure is not None:
        notes.append(failure.line)
    if status == "unsupported" and not notes:
        notes.append(f"no CUDA graph capture in the log (cudagraph_mode {effective_mode or requested_mode or 'unknown'})")
    return GraphCapture(
        status=status,
        mode=effective_mode if effective_mode is not None else requested_mode,
        sizes=sizes if status == "captured" else [],
        seconds=float(done.group(1)) if done else None,
        bytes=int(float(done.group(2)) * (1 << 30)) if done else None,
        eager_fallback_sizes=fallback,
        detail="; ".join(notes) or None,
    )
