#!/bin/bash
# Session 5, call 26 (1 x H200; carry .whl .device). Two programs per SM: 264 (and 256) programs of 4 warps each
# (255 registers a thread fit two per SM) against 132 programs of 8 warps, same kernel.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/q; T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/q/timeline.log; }
el p132; timeout 100 python3 bench/fused_decode_bench.py --out /tmp/q/p132.json --tilings 8x32xaxdxqm --phase-tilings "" \
  > /tmp/q/p132.log 2>&1; el rc $?
for P in 264 256; do
  el p$P; timeout 120 python3 bench/fused_decode_bench.py --programs $P --out /tmp/q/p$P.json \
    --tilings 4x16xaxdxqm,4x8xaxdxqm,4x16xaxdxq --phase-tilings 4x16xaxdxqm > /tmp/q/p$P.log 2>&1; el rc $?
done
cd /tmp && tar czf $OUT/q.tgz q; el done
