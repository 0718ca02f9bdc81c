#!/bin/bash
# Session 7, call 40 (1 x H200; carry .whl). Call 39 showed the Triton paged attention does not scale with context at
# small batches: one program per (request, KV head) walks every key (3,968 keys: 4.66 ms a step at batch 1 and 8).
# It now splits each row's keys over several programs (flash-decoding) and merges them in a second kernel.
# Its GPU tests (with long rows that split), the graph test, then the long-context benchmark again, and the short
# context at max_model_len 2048 (splits with mostly empty shares: must not cost the short step much; call 30: 1.256 /
# 1.222 ms at batch 1 / 8).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/q; T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/q/timeline.log; }
el tests; timeout 110 python3 -m pytest -q -rA tests/test_gpu.py -k "paged_attention or in_graphs" -p no:cacheprovider > /tmp/q/gputests.log 2>&1; el rc $?
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" /tmp/q/gputests.log | tail -14
el long; timeout 140 python3 bench/gpu_bench.py --models qwen3-0.6b-shape --variants compile+triton+attn --no-spec \
  --prompt-tokens 3840 --out /tmp/q/bench-long.json > /tmp/q/bench-long.log 2>&1; el rc $?
grep -A4 "^model" /tmp/q/bench-long.log
el short2048; timeout 110 python3 bench/gpu_bench.py --models qwen3-0.6b-shape --variants compile+triton+attn --no-spec \
  --max-model-len 2048 --out /tmp/q/bench-2048.json > /tmp/q/bench-2048.log 2>&1; el rc $?
grep -A4 "^model" /tmp/q/bench-2048.log
cd /tmp && tar czf $OUT/q.tgz q; el done
