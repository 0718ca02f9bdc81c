#!/bin/bash
# Prepared for the next session (1 x H200; carry .whl). The last commits of session 4 changed the fused kernel
# after its last GPU run (call 18): one RMSNorm helper, and a sticky timeout flag with its own pointer. They were
# checked under Triton's interpreter and compiled offline for sm_90 with Triton 3.6 (bench/kernel_resources.py),
# not run on a GPU. This call re-runs the GPU tests and the microbench before any new optimisation.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/q; T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/q/timeline.log; }
el tests; timeout 170 python3 -m pytest -q tests/test_gpu.py -k "not nccl" -p no:cacheprovider > /tmp/q/gputests.log 2>&1; el tests rc $?
el micro; timeout 150 python3 bench/fused_decode_bench.py --out /tmp/q/fused.json > /tmp/q/fused.log 2>&1; el micro rc $?
el bench; timeout 150 python3 bench/gpu_bench.py --models qwen3-0.6b-shape --variants fused --no-spec \
  --out /tmp/q/bench.json > /tmp/q/bench.log 2>&1; el bench rc $?
cd /tmp && tar czf $OUT/q.tgz q; el done
