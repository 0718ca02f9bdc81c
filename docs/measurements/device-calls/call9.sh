#!/bin/bash
# Device call 9 (1 x H200), the session's last minutes: the single-GPU tests after the dynamo-entry fix,
# the 0.6B-shape step with compile + the tuned Triton kernel (profile), the GEMV comparison with cold L2.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/q/timeline.log; }
mkdir -p /tmp/q
el tests; timeout 110 python3 -m pytest -s -q tests/test_gpu.py -k "graphs or skinny or triton" -p no:cacheprovider > /tmp/q/gputests.log 2>&1; el tests rc $?
el prof; timeout 75 python3 bench/profile_decode.py --compile default --triton-gemm --out /tmp/q/prof.json > /tmp/q/prof.log 2>&1; el prof rc $?
el gemv; timeout 40 python3 bench/gemv_bench.py --out /tmp/q/gemv.json > /tmp/q/gemv.log 2>&1; el gemv rc $?
cd /tmp && tar czf $OUT/q.tgz q; el done
