#!/bin/bash
# (.device/ is git-ignored: alt_bench.py is kept as docs/measurements/s5/call25/alt_bench.py; orig_decode_layers.py is
# qual/runtime/kernels/decode_layers.py at commit 16f5c74, alt_decode_layers.py that file with RoPE once a launch.)
# Session 5, call 29 (1 x H200; carry .whl .device). The fused kernel now reads keys only up to the token's position
# and splits those over the chunks; before, it split the graph's static key width (max_model_len) and read all of
# it, masked. Kernel layers with 161 keys in a 2048-wide key view, new vs old (commit 16f5c74, via alt_bench), then
# the fused GPU tests and the end-to-end decode at max_model_len 2048.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/q; T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/q/timeline.log; }
for v in new:qual/runtime/kernels/decode_layers.py old:.device/orig_decode_layers.py; do
  for W in 161 2048; do
    el ${v%%:*} $W; timeout 90 python3 .device/alt_bench.py ${v#*:} --key-width $W --tilings 8x32xaxdxqm --phase-tilings "" \
      --out /tmp/q/fused-${v%%:*}-$W.json > /tmp/q/fused-${v%%:*}-$W.log 2>&1; el rc $?
  done
done
el tests; timeout 120 python3 -m pytest -q tests/test_gpu.py -k fused -p no:cacheprovider > /tmp/q/gputests.log 2>&1; el rc $?
el bench; timeout 200 python3 bench/gpu_bench.py --models qwen3-0.6b-shape --variants compile+triton+attn,fused --no-spec \
  --max-model-len 2048 --out /tmp/q/bench-2048.json > /tmp/q/bench-2048.log 2>&1; el rc $?
cd /tmp && tar czf $OUT/q.tgz q; el done
