#!/bin/bash
# Session 6, call 33 (1 x H200; carry .whl .device): the kernel after dropping call 32's short-context path (kept: the
# attention loop that requests the next key block before using the one in hand, key blocks of up to 64). GPU tests of
# the fused path; the fused kernel alone with tl.dot vs broadcast attention at 160 and 600 cached tokens; per-phase
# times with each program's barrier arrivals (how long barriers wait for the last program, and which programs).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/q; T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/q/timeline.log; }
el tests; timeout 150 python3 -m pytest -q -rA tests/test_gpu.py -k "fused_decode" -p no:cacheprovider > /tmp/q/gputests.log 2>&1; el rc $?
el fused160; timeout 150 python3 bench/fused_decode_bench.py --tilings 8x32xaxdxqm,8x32xaxbxqm \
  --phase-tilings 8x32xaxdxqm,8x32xaxbxqm --out /tmp/q/fused160.json > /tmp/q/fused160.log 2>&1; el rc $?
el fused600; timeout 90 python3 bench/fused_decode_bench.py --context 600 --tilings 8x32xaxdxqm,8x32xaxbxqm,8x32xaxdxqmxb32 \
  --phase-tilings "" --out /tmp/q/fused600.json > /tmp/q/fused600.log 2>&1; el rc $?
cd /tmp && tar czf $OUT/q.tgz q; el done
