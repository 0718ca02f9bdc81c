#!/bin/bash
# Session 5, call 21 (1 x H200; carry .whl .device). Calls 19-20: L2 prefetch (per-thread or bulk) made the kernel
# slower. Is the kernel HBM-bound at all? One layer (31.5 MB, stays in L2 across graph replays) vs two (63 MB, does
# not) vs 28, per phase; and warps / MLP-step variants on all 28 layers.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/q; T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/q/timeline.log; }
for L in 1 2; do
  el layers$L; timeout 120 python3 bench/fused_decode_bench.py --layers $L --out /tmp/q/fused-l$L.json \
    --tilings 8x32xaxdxqmx0 --phase-tilings 8x32xaxdxqmx0 > /tmp/q/fused-l$L.log 2>&1; el rc $?
done
el warps; timeout 200 python3 bench/fused_decode_bench.py --out /tmp/q/fused-28.json \
  --tilings 8x32xaxdxqmx0,16x32xaxdxqmx0,4x16xaxdxqmx0,8x16xaxdxqmx0,8x8xaxdxqmx0 --phase-tilings 16x32xaxdxqmx0 \
  > /tmp/q/fused-28.log 2>&1; el rc $?
cd /tmp && tar czf $OUT/q.tgz q; el done
