#!/bin/bash
# Device call 16 (session 4, 1 x H200): attention split over the keys (flash-decoding inside the kernel:
# partial phase + merge/o-projection phase, cached keys requested before the barrier); microbench, GPU test, end to end.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/q; T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/q/timeline.log; }
el micro; timeout 150 python3 bench/fused_decode_bench.py --out /tmp/q/fused.json > /tmp/q/fused.log 2>&1; el micro rc $?
grep -v Warn /tmp/q/fused.log | grep -v warnings.warn | tail -11
el tests; timeout 100 python3 -m pytest -q tests/test_gpu.py -k "fused" -p no:cacheprovider > /tmp/q/gputests.log 2>&1; el tests rc $?
tail -2 /tmp/q/gputests.log
el bench; timeout 150 python3 bench/gpu_bench.py --models qwen3-0.6b-shape --variants fused --no-spec \
  --out /tmp/q/bench.json > /tmp/q/bench.log 2>&1; el bench rc $?
tail -5 /tmp/q/bench.log
cd /tmp && tar czf $OUT/q.tgz q; el done
