#!/bin/bash
# Device call 17 (session 4, 1 x H200): which weights to request before a barrier (prefetch into registers
# can spill): the microbench alone.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 120 python3 bench/fused_decode_bench.py --tilings 8x32xaxdxqm,8x32xaxdxq,8x32xaxdx,8x16xaxdx --out $OUT/fused.json 2>&1 \
  | grep -v -i warn | tee $OUT/fused.log | tail -12
