"""VllmClient.complete reads a streamed /v1/completions reply (server-sent events, as vLLM 0.32 sends them with
`stream_options.include_usage`): each step's tokens timed as they arrive, the per-request spec-decode metrics from the
usage event at the end; a reply sent whole is still read, timed end to end only."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from latency_checks import assert_latency_consistent
from qual.engines.vllm.client import ClientError, VllmClient
from qual.records import RequestResult

SPEC = {"num_spec_tokens": 3, "num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 3,
        "acceptance_histogram": [0, 1, 1, 0]}
GAP_S = 0.15


def _event(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


STREAM = [  # as vLLM streams a completion of 6 tokens in three steps (1, 2, 3 tokens), then its usage
    {"choices": [{"index": 0, "text": "a", "token_ids": [7], "prompt_token_ids": [1, 2, 3], "finish_reason": None}]},
    {"choices": [{"index": 0, "text": "bc", "token_ids": [8, 9], "finish_reason": None}]},
    {"choices": [{"index": 0, "text": "def", "token_ids": [10, 11, 12], "finish_reason": "length"}]},
    {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 6}, "system_fingerprint": "vllm-0.32.0",
     "metrics": {"speculative_decoding": SPEC}},
]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(body)
        self.server.reply(self)

    def log_message(self, *args):
        pass


def streamed(h, events=STREAM):
    h.send_response(200)
    h.send_header("Content-Type", "text/event-stream")
    h.end_headers()
    for i, event in enumerate(events):
        if i:
            time.sleep(GAP_S)
        h.wfile.write(_event(event))
        h.wfile.flush()
    h.wfile.write(b"data: [DONE]\n\n")


def whole(h):
    body = json.dumps({"choices": [{"token_ids": [7, 8], "prompt_token_ids": [1, 2, 3], "finish_reason": "stop"}],
                       "metrics": {"speculative_decoding": SPEC}}).encode()
    h.send_response(200)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    h.wfile.write(body)


@pytest.fixture
def serve():
    servers = []

    def start(reply):
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        server.reply, server.seen = reply, []
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server, VllmClient(f"http://127.0.0.1:{server.server_address[1]}", "toy", timeout_s=10)

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _result(c) -> RequestResult:
    return RequestResult("r", "c", c.prompt_token_ids, c.output_token_ids, 0, 0, 0, [], c.finish_reason,
                         latency=c.latency)


def test_a_streamed_reply_times_each_step_and_keeps_the_usage_events_metrics(serve):
    server, client = serve(streamed)
    c = client.complete([1, 2, 3], 6, 0.0, 0)
    sent = server.seen[0]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["return_token_ids"] is True and sent["prompt"] == [1, 2, 3]
    assert c.output_token_ids == [7, 8, 9, 10, 11, 12] and c.prompt_token_ids == [1, 2, 3]
    assert c.finish_reason == "length" and c.spec_decode == SPEC and c.fingerprint == "vllm-0.32.0"
    steps = c.latency["step_times_s"]
    assert len(steps) == 3 and all(b - a >= GAP_S * 0.9 for a, b in zip(steps, steps[1:]))
    assert c.latency["tpot_s"] == pytest.approx((steps[-1] - steps[0]) / 5, abs=1e-6)
    assert c.latency["e2e_s"] >= steps[-1] + GAP_S * 0.9  # the usage event came one gap after the last tokens
    assert c.latency["decode_steps_s"] == pytest.approx(steps[-1] - steps[0], abs=1e-6)
    RequestResult.from_json(_result(c).to_json())


def test_a_reply_sent_whole_is_read_and_timed_end_to_end(serve):
    _, client = serve(whole)
    c = client.complete([1, 2, 3], 2, 0.0, 0)
    assert c.output_token_ids == [7, 8] and c.spec_decode == SPEC and c.finish_reason == "stop"
    assert_latency_consistent(_result(c), streamed=False)


def test_an_error_event_mid_stream_is_a_client_error(serve):
    error = {"error": {"message": "engine died\nbadly", "type": "InternalServerError", "code": 500}}
    _, client = serve(lambda h: streamed(h, [STREAM[0], error]))
    with pytest.raises(ClientError, match="failed mid-stream: engine died badly"):
        client.complete([1, 2, 3], 6, 0.0, 0)


def test_a_stream_without_token_ids_is_refused(serve):
    _, client = serve(lambda h: streamed(h, [{"choices": [{"index": 0, "text": "a"}]}]))
    with pytest.raises(ClientError, match="no token_ids"):
        client.complete([1, 2, 3], 6, 0.0, 0)
    _, client = serve(lambda h: streamed(h, [{"choices": [{"index": 0, "token_ids": ["x"]}]}]))
    with pytest.raises(ClientError, match="not integers"):
        client.complete([1, 2, 3], 6, 0.0, 0)
