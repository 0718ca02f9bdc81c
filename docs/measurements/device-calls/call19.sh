#!/bin/bash
# Session 5, call 19 (1 x H200; carry .whl .device): re-verify session 4's last kernel edits (never GPU-run), then
# the L2 prefetch of weights ahead of their phase (Tiling.l2_ahead: 0 = off .. 3), microbench + per-phase, and the
# end-to-end bench with the new default (l2_ahead 2).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/q; T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/q/timeline.log; }
nvidia-smi --query-gpu=name,utilization.gpu,memory.used --format=csv > /tmp/q/smi.txt 2>&1
el micro; timeout 200 python3 bench/fused_decode_bench.py --out /tmp/q/fused.json \
  --tilings 8x32xaxdxqmx0,8x32xaxdxqmx1,8x32xaxdxqmx2,8x32xaxdxqmx3,8x32xaxdxqx2,8x16xaxdxqmx2 \
  --phase-tilings 8x32xaxdxqmx0,8x32xaxdxqmx2 > /tmp/q/fused.log 2>&1; el micro rc $?
el tests; timeout 170 python3 -m pytest -q tests/test_gpu.py -k "not nccl" -p no:cacheprovider > /tmp/q/gputests.log 2>&1; el tests rc $?
el bench; timeout 150 python3 bench/gpu_bench.py --models qwen3-0.6b-shape --variants fused --no-spec \
  --out /tmp/q/bench.json > /tmp/q/bench.log 2>&1; el bench rc $?
cd /tmp && tar czf $OUT/q.tgz q; el done
