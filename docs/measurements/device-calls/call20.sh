#!/bin/bash
# Session 5, call 20 (1 x H200; carry .whl .device). Call 19: L2 prefetch with per-thread prefetch.global.L2 made
# the kernel slower (737 -> 805-830 us). Now: one bulk prefetch (TMA) per program instead, thread-0-only barrier
# polls (poll t), per-phase breakdowns, the fused GPU test over three tilings, and gpu_bench with the fastest tiling.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/q; T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/q/timeline.log; }
nvidia-smi --query-gpu=name,utilization.gpu,memory.used --format=csv > /tmp/q/smi.txt 2>&1
el micro; timeout 200 python3 bench/fused_decode_bench.py --out /tmp/q/fused.json \
  --tilings 8x32xaxdxqmx0,8x32xtxdxqmx0,8x32xaxdxqmx1,8x32xaxdxqmx2,8x32xaxdxqmx3,8x32xaxdxqmx4,8x32xtxdxqmx2 \
  --phase-tilings 8x32xaxdxqmx0,8x32xaxdxqmx2,8x32xtxdxqmx2 > /tmp/q/fused.log 2>&1; el micro rc $?
el tests; timeout 150 python3 -m pytest -q tests/test_gpu.py -k fused -p no:cacheprovider > /tmp/q/gputests.log 2>&1; el tests rc $?
BEST=$(python3 -c "import json; t=json.load(open('/tmp/q/fused.json'))['tilings']; print(min((v['us'], k) for k, v in t.items() if 'us' in v)[1])")
el bench $BEST; timeout 150 python3 bench/gpu_bench.py --models qwen3-0.6b-shape --variants fused --no-spec \
  --fused-tiling "$BEST" --out /tmp/q/bench.json > /tmp/q/bench.log 2>&1; el bench rc $?
cd /tmp && tar czf $OUT/q.tgz q; el done
