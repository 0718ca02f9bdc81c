#!/bin/bash
# Device call 18 (session 4, 1 x H200): the final numbers (after the split-key attention, calls 16-17). GPU tests (one GPU), then the
# 0.6B-shape step: base, compile+triton+attn (per-layer kernels) and fused (one kernel, MLP rows in one step).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/q; T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/q/timeline.log; }
el tests; timeout 170 python3 -m pytest -q tests/test_gpu.py -k "not nccl" -p no:cacheprovider > /tmp/q/gputests.log 2>&1; el tests rc $?
tail -3 /tmp/q/gputests.log
el bench; timeout 330 python3 bench/gpu_bench.py --models qwen3-0.6b-shape --variants base,compile+triton+attn,fused --no-spec \
  --out /tmp/q/bench.json > /tmp/q/bench.log 2>&1; el bench rc $?
tail -9 /tmp/q/bench.log
cd /tmp && tar czf $OUT/q.tgz q; el done
