#!/bin/bash
# Device call 10 (session 4, 1 x H200): first GPU run of the one-kernel decode step (fused_decode):
# per-tiling microbench, the GPU test against the per-layer path, then the 0.6B-shape step end to end.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/q; T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/q/timeline.log; }
el micro; timeout 200 python3 bench/fused_decode_bench.py --out /tmp/q/fused.json > /tmp/q/fused.log 2>&1; el micro rc $?
tail -12 /tmp/q/fused.log
el tests; timeout 150 python3 -m pytest -s -q tests/test_gpu.py -k "fused or triton" -p no:cacheprovider > /tmp/q/gputests.log 2>&1; el tests rc $?
tail -5 /tmp/q/gputests.log
el bench; timeout 200 python3 bench/gpu_bench.py --models qwen3-0.6b-shape --variants base,fused,compile+triton+attn --no-spec \
  --out /tmp/q/bench.json > /tmp/q/bench.log 2>&1; el bench rc $?
tail -8 /tmp/q/bench.log
cd /tmp && tar czf $OUT/q.tgz q; el done
