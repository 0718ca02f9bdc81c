#!/bin/bash
# Device call 11 (session 4, 1 x H200): the one-kernel step after volatile-poll barriers, tl.dot attention and
# early o-projection loads; per-phase timestamps (bench/fused_decode_bench.py), the GPU test again.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/q; T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/q/timeline.log; }
el micro; timeout 200 python3 bench/fused_decode_bench.py --out /tmp/q/fused.json > /tmp/q/fused.log 2>&1; el micro rc $?
tail -14 /tmp/q/fused.log
el tests; timeout 120 python3 -m pytest -s -q tests/test_gpu.py -k "fused" -p no:cacheprovider > /tmp/q/gputests.log 2>&1; el tests rc $?
tail -3 /tmp/q/gputests.log
cd /tmp && tar czf $OUT/q.tgz q; el done
