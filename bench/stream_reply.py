"""Host cost of reading one streamed /v1/completions event (the per-token path of the vLLM engines): microseconds an
event through `CompletionStream.line`, which parses it with the strict bounded JSON loader (qual/userfiles.py), and
the parse alone next to plain `json.loads`.

    python bench/stream_reply.py [--events 512 --repeats 40]

The events are shaped as vLLM 0.32 streams a completion with `return_token_ids` (one or a few tokens an event, the
prompt's ids in the first, the usage and spec-decode metrics in the last). The figure printed is the median over
the repeats of a whole stream's time divided by its events.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from qual.engines.vllm.client import CompletionStream


def stream(events: int) -> list[bytes]:
    """`data: {...}` lines of a completion of `events` steps, then its usage event and [DONE]."""
    out = []
    for i in range(events):
        choice = {"index": 0, "text": " tok", "logprobs": None, "finish_reason": None if i < events - 1 else "length",
                  "stop_reason": None, "token_ids": [1000 + i % 3000, 17], "prompt_logprobs": None}
        if i == 0:
            choice["prompt_token_ids"] = list(range(100, 612))
        out.append(b"data: " + json.dumps({"id": "cmpl-5f1c0a9e8e2d4b51", "object": "text_completion",
                                           "created": 1764000000, "model": "toy", "choices": [choice],
                                           "usage": None}).encode())
    out.append(b"data: " + json.dumps({
        "id": "cmpl-5f1c0a9e8e2d4b51", "object": "text_completion", "created": 1764000000, "model": "toy",
        "choices": [], "usage": {"prompt_tokens": 512, "total_tokens": 512 + 2 * events, "completion_tokens": 2 * events},
        "system_fingerprint": "vllm-0.32.0",
        "metrics": {"speculative_decoding": {"num_spec_tokens": 7, "num_drafts": events, "num_draft_tokens": 7 * events,
                                             "num_accepted_tokens": events, "acceptance_histogram": [0] * 8}}}).encode())
    out.append(b"data: [DONE]")
    return out


def per_event_us(lines: list[bytes], repeats: int, read) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        read(lines)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / len(lines) * 1e6


def through_stream(lines: list[bytes]) -> None:
    reply = CompletionStream()
    for i, line in enumerate(lines):
        reply.line(line, float(i))
        reply.line(b"", float(i))  # the blank line between events


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=40)
    a = ap.parse_args()
    lines = stream(a.events)
    payloads = [line[5:].strip() for line in lines[:-1]]
    print(f"CompletionStream.line: {per_event_us(lines, a.repeats, through_stream):.2f} us an event "
          f"({a.events} events + usage, median of {a.repeats} streams)")
    print(f"json.loads alone: {per_event_us(payloads, a.repeats, lambda ps: [json.loads(p) for p in ps]):.2f} us")
    try:
        from qual.userfiles import load_reply
    except ImportError:  # a qual from before the bounded reply loader
        return
    print(f"load_reply alone: {per_event_us(payloads, a.repeats, lambda ps: [load_reply(p, 'e') for p in ps]):.2f} us")


if __name__ == "__main__":
    main()
