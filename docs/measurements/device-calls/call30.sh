#!/bin/bash
# Session 5, call 30 (1 x H200; carry .whl .device). The Triton paged attention now stops at each row's key count
# (KeyView.lengths). GPU tests of the kernels and graphs, then compile+triton+attn at max_model_len 2048 (call 29:
# 2.716 ms a step at batch 1, 3.215 ms at batch 8, against 1.241 / 1.318 ms at width 192).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/q; T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/q/timeline.log; }
el tests; timeout 120 python3 -m pytest -q tests/test_gpu.py -k "paged or triton or fused or graphs" -p no:cacheprovider \
  > /tmp/q/gputests.log 2>&1; el rc $?
el bench; timeout 130 python3 bench/gpu_bench.py --models qwen3-0.6b-shape --variants compile+triton+attn --no-spec \
  --max-model-len 2048 --out /tmp/q/bench-2048.json > /tmp/q/bench-2048.log 2>&1; el rc $?
cd /tmp && tar czf $OUT/q.tgz q; el done
