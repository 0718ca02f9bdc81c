#!/bin/bash
# Session 6, call 31 (1 x H200; carry .whl .device): every one-GPU test (the attention graph test missed in call 30),
# and today's baseline of the fused kernel alone, per phase.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/q; T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/q/timeline.log; }
el tests; timeout 300 python3 -m pytest -q -rA tests/test_gpu.py -k "not nccl" -p no:cacheprovider > /tmp/q/gputests.log 2>&1; el rc $?
el fused; timeout 120 python3 bench/fused_decode_bench.py --tilings 8x32xaxdxqm --out /tmp/q/fused.json > /tmp/q/fused.log 2>&1; el rc $?
cd /tmp && tar czf $OUT/q.tgz q; el done
