#!/bin/bash
# Session 7, call 39 (1 x H200; carry .whl). The long-context regime that DCP exists for: the 0.6B shape's decode
# step after 3,840-token random prompts (3,968 keys at the measured step), batch 1 and 8, compiled + Triton GEMM +
# attention and the fused kernel. Here the step reads more KV than weights (batch 8: 3.6 GB of KV, 1.2 GB of weights).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/q; T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/q/timeline.log; }
el bench; timeout 400 python3 bench/gpu_bench.py --models qwen3-0.6b-shape --variants compile+triton+attn,fused --no-spec \
  --prompt-tokens 3840 --out /tmp/q/bench-long.json > /tmp/q/bench-long.log 2>&1; el rc $?
grep -v "^DEBUG\|^W1\|^I1" /tmp/q/bench-long.log | tail -12
cd /tmp && tar czf $OUT/q.tgz q; el done
