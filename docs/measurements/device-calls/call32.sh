#!/bin/bash
# Session 6, call 32 (1 x H200; carry .whl .device): short contexts skip the merge phase (each unit of a KV head
# attends all its keys, then its o rows). Correctness on the GPU, then the fused kernel alone against the split
# path (k0; b16 = the old default at this width), at 160, 250 and 600 cached tokens, then end to end.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/q; T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/q/timeline.log; }
el tests; timeout 150 python3 -m pytest -q -rA tests/test_gpu.py -k "fused_decode" -p no:cacheprovider > /tmp/q/gputests.log 2>&1; el rc $?
el fused160; timeout 120 python3 bench/fused_decode_bench.py --tilings 8x32xaxdxqmxk0xb16,8x32xaxdxqmxk0xb64,8x32xaxdxqm,8x32xaxdxqmxk256xb32,8x32xaxdxqmxk256xb128 \
  --phase-tilings 8x32xaxdxqmxk0xb16,8x32xaxdxqm --out /tmp/q/fused160.json > /tmp/q/fused160.log 2>&1; el rc $?
el fused250; timeout 90 python3 bench/fused_decode_bench.py --context 250 --tilings 8x32xaxdxqmxk0xb32,8x32xaxdxqm,8x32xaxdxqmxk256xb32 \
  --phase-tilings "" --out /tmp/q/fused250.json > /tmp/q/fused250.log 2>&1; el rc $?
el fused600; timeout 90 python3 bench/fused_decode_bench.py --context 600 --tilings 8x32xaxdxqmxk0xb32,8x32xaxdxqm \
  --phase-tilings "" --out /tmp/q/fused600.json > /tmp/q/fused600.log 2>&1; el rc $?
el bench; timeout 150 python3 bench/gpu_bench.py --models qwen3-0.6b-shape --variants fused --no-spec \
  --out /tmp/q/bench.json > /tmp/q/bench.log 2>&1; el rc $?
cd /tmp && tar czf $OUT/q.tgz q; el done
