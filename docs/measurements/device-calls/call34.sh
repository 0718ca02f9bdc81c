#!/bin/bash
# Session 6, call 34 (1 x H200; carry .whl .device): a unit's 24 MLP rows as tiles of 16 + 8 (no register row of
# padding, 144 registers a thread instead of 192) and the option of requesting the first 16 two barriers ahead (M), so
# they stream in during the merge phase. GPU tests of the fused path; the kernel alone and per phase; end to end.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/q; T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/q/timeline.log; }
el tests; timeout 150 python3 -m pytest -q -rA tests/test_gpu.py -k "fused_decode" -p no:cacheprovider > /tmp/q/gputests.log 2>&1; el rc $?
el fused160; timeout 150 python3 bench/fused_decode_bench.py --tilings 8x32xaxdxqm,8x32xaxdxqM,8x32xaxdxq \
  --phase-tilings 8x32xaxdxqm,8x32xaxdxqM --out /tmp/q/fused160.json > /tmp/q/fused160.log 2>&1; el rc $?
el fused600; timeout 90 python3 bench/fused_decode_bench.py --context 600 --tilings 8x32xaxdxqm,8x32xaxdxqM \
  --phase-tilings "" --out /tmp/q/fused600.json > /tmp/q/fused600.log 2>&1; el rc $?
el bench; timeout 150 python3 bench/gpu_bench.py --models qwen3-0.6b-shape --variants fused --no-spec \
  --out /tmp/q/bench.json > /tmp/q/bench.log 2>&1; el rc $?
cd /tmp && tar czf $OUT/q.tgz q; el done
