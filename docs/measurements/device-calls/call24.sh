#!/bin/bash
# Session 5, call 24 (1 x H200; carry .whl .device). After call 22's Nsight Compute attribution: the LSE merge as an
# unrolled loop over chunks (no cross-warp sum), down^T read as row pairs (its sum stays in-thread), RoPE cos/sin
# once a launch. Microbench + per phase, the fused GPU tests, gpu_bench fused, and ncu again for the stall mix.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/q; T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/q/timeline.log; }
el micro; timeout 150 python3 bench/fused_decode_bench.py --out /tmp/q/fused.json --tilings 8x32xaxdxqm,8x16xaxdxqm \
  --phase-tilings 8x32xaxdxqm > /tmp/q/fused.log 2>&1; el rc $?
el tests; timeout 120 python3 -m pytest -q tests/test_gpu.py -k fused -p no:cacheprovider > /tmp/q/gputests.log 2>&1; el rc $?
el bench; timeout 150 python3 bench/gpu_bench.py --models qwen3-0.6b-shape --variants fused --no-spec \
  --out /tmp/q/bench.json > /tmp/q/bench.log 2>&1; el rc $?
el ncu; timeout 150 ncu --clock-control none --set full --import-source yes -k regex:_decode_layers_kernel -c 1 \
  -o /tmp/q/fused python3 bench/fused_decode_bench.py --tilings 8x32xaxdxqm --phase-tilings "" --out /tmp/q/f.json \
  > /tmp/q/ncu.log 2>&1; el rc $?
ncu -i /tmp/q/fused.ncu-rep --page details > /tmp/q/details.txt 2>&1
ncu -i /tmp/q/fused.ncu-rep --page source --csv --print-source sass > /tmp/q/source-sass.csv 2>&1
mv /tmp/q/fused.ncu-rep $OUT/ 2>/dev/null
cd /tmp && tar czf $OUT/q.tgz q; el done
