#!/bin/bash
# Session 5, call 22 (1 x H200; carry .whl .device). Call 21: with one layer's weights resident in L2 the kernel is no
# faster per layer, so it is not bound by HBM. Where does a phase's time go? Nsight Compute on one launch: warp
# stall reasons for the kernel and per source line (if this machine's runtime lets ncu read the counters).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/q; T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/q/timeline.log; }
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1); el "ncu=$NCU"
el profile; timeout 300 $NCU --clock-control none --set full --import-source yes -k regex:_decode_layers_kernel -c 1 \
  -o /tmp/q/fused python3 bench/fused_decode_bench.py --tilings 8x32xaxdxqm --phase-tilings "" --out /tmp/q/f.json \
  > /tmp/q/ncu.log 2>&1; el rc $?
$NCU -i /tmp/q/fused.ncu-rep --page details > /tmp/q/details.txt 2>&1; el details rc $?
$NCU -i /tmp/q/fused.ncu-rep --page raw --csv > /tmp/q/raw.csv 2>&1; el raw rc $?
$NCU -i /tmp/q/fused.ncu-rep --page source --csv --print-source sass > /tmp/q/source-sass.csv 2>&1; el sass rc $?
$NCU -i /tmp/q/fused.ncu-rep --page source --csv --print-source py > /tmp/q/source-py.csv 2>&1; el py rc $?
ls -la /tmp/q >> /tmp/q/timeline.log; mv /tmp/q/fused.ncu-rep $OUT/ 2>/dev/null
cd /tmp && tar czf $OUT/q.tgz q; el done
