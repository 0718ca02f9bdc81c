#!/bin/bash
# (.device/ is git-ignored: alt_bench.py is kept as docs/measurements/s5/call25/alt_bench.py; orig_decode_layers.py is
# qual/runtime/kernels/decode_layers.py at commit 16f5c74, alt_decode_layers.py that file with RoPE once a launch.)
# Session 5, call 25 (1 x H200; carry .whl .device). Call 24 was slower (merge as a loop). Three kernels side by side:
# A = the working tree (down^T as row pairs, residual by its own atomic, RoPE once a launch, tensor merge),
# B = session 4's kernel + RoPE once a launch only, C = session 4's kernel (commit 16f5c74). Then the fused GPU tests.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/q; T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/q/timeline.log; }
for v in A:qual/runtime/kernels/decode_layers.py B:.device/alt_decode_layers.py C:.device/orig_decode_layers.py; do
  el ${v%%:*}; timeout 100 python3 .device/alt_bench.py ${v#*:} --out /tmp/q/fused-${v%%:*}.json --tilings 8x32xaxdxqm \
    --phase-tilings 8x32xaxdxqm > /tmp/q/fused-${v%%:*}.log 2>&1; el rc $?
done
el tests; timeout 120 python3 -m pytest -q tests/test_gpu.py -k fused -p no:cacheprovider > /tmp/q/gputests.log 2>&1; el rc $?
cd /tmp && tar czf $OUT/q.tgz q; el done
