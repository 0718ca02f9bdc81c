#!/bin/bash
# Session 5, call 27 (1 x H200; carry .whl .device). Call 26: a barrier of 264 programs costs ~0.6 us more than one
# of 132 (~4.5 ns an arrival: same-address atomics are served one by one). Arrivals split over 1..16 counters.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/q; T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/q/timeline.log; }
el micro; timeout 200 python3 bench/fused_decode_bench.py --out /tmp/q/fused.json \
  --tilings 8x32xaxdxqmx1,8x32xaxdxqmx2,8x32xaxdxqmx4,8x32xaxdxqmx8,8x32xaxdxqmx16,8x32xvxdxqmx8,8x32xaxdxqmx1 \
  --phase-tilings 8x32xaxdxqmx1,8x32xaxdxqmx8 > /tmp/q/fused.log 2>&1; el rc $?
el tests; timeout 120 python3 -m pytest -q tests/test_gpu.py -k fused -p no:cacheprovider > /tmp/q/gputests.log 2>&1; el rc $?
cd /tmp && tar czf $OUT/q.tgz q; el done
