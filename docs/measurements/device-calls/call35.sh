#!/bin/bash
# Session 6, call 35 (1 x H200; carry .whl .device): the end-of-session tree. Every GPU test but the 2-GPU ones, and
# the decode benchmark of the three main variants on the 0.6B shape (as call 28).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/q; T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/q/timeline.log; }
el tests; timeout 240 python3 -m pytest -q -rA tests/test_gpu.py -k "not nccl" -p no:cacheprovider > /tmp/q/gputests.log 2>&1; el rc $?
el bench; timeout 300 python3 bench/gpu_bench.py --models qwen3-0.6b-shape --variants base,compile+triton+attn,fused --no-spec \
  --out /tmp/q/bench.json > /tmp/q/bench.log 2>&1; el rc $?
cd /tmp && tar czf $OUT/q.tgz q; el done
