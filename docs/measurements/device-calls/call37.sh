#!/bin/bash
# Session 6, call 37 (1 x H200; carry .whl .device): graph_capture.bytes measured from an emptied allocator cache, and
# generation timed apart from engine start-up. Every one-GPU test (with the new two-identical-engines test), then call
# 36's qual run again: two identical arms must now report the same graph memory.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/q; T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/q/timeline.log; }
el tests; timeout 240 python3 -m pytest -q -rA tests/test_gpu.py -k "not nccl" -p no:cacheprovider > /tmp/q/gputests.log 2>&1; el rc $?
el run; timeout 120 python3 -m qual run --dcp 1 --device cuda --limit 64 --out /tmp/q/toy > /tmp/q/toy.log 2>&1; el rc $?
python3 - > /tmp/q/arms.txt 2>&1 <<'PY'
import json
r = json.load(open("/tmp/q/toy/result.json"))
for a in ("control", "candidate"):
    x = r["arms"][a]
    print(a, x["graph_capture"]["bytes"], x["graph_capture"]["seconds"], x["throughput"])
PY
cat /tmp/q/arms.txt
cd /tmp && tar czf $OUT/q.tgz q; el done
