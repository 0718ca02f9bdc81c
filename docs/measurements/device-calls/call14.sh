#!/bin/bash
# Device call 14 (session 4, 1 x H200): K/V loads wait only on the slots (mask preloaded), MLP steps of 16 rows;
# attention diagnostics (key loop / o projection left out); GPU test; the 0.6B step end to end.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/q; T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/q/timeline.log; }
el micro; timeout 200 python3 bench/fused_decode_bench.py --out /tmp/q/fused.json > /tmp/q/fused.log 2>&1; el micro rc $?
tail -14 /tmp/q/fused.log
el tests; timeout 120 python3 -m pytest -s -q tests/test_gpu.py -k "fused" -p no:cacheprovider > /tmp/q/gputests.log 2>&1; el tests rc $?
tail -3 /tmp/q/gputests.log
el bench; timeout 200 python3 bench/gpu_bench.py --models qwen3-0.6b-shape --variants fused --no-spec \
  --out /tmp/q/bench.json > /tmp/q/bench.log 2>&1; el bench rc $?
tail -6 /tmp/q/bench.log
cd /tmp && tar czf $OUT/q.tgz q; el done
