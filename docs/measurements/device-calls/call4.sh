#!/bin/bash
# Device call 4 (2 x H200): NCCL + CUDA graphs after the teardown fix: 2-GPU tests, then qual run --dcp 2 with graphs.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 QUAL_HANG_DUMP_S=40 PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/o/timeline.log; }
mkdir -p /tmp/o
el tests; timeout 75 python3 -m pytest -s -q -x tests/test_gpu.py -k nccl -p no:cacheprovider > /tmp/o/gputests.log 2>&1; el tests rc $?
for mode in replicated sharded; do
  el run $mode; timeout 55 python3 -m qual run --dcp 2 --device cuda --limit 32 --draft-kv $mode --out /tmp/o/$mode --history /tmp/hist.sqlite > /tmp/o/$mode.log 2>&1; el run $mode rc $?
done
cd /tmp && tar czf $OUT/o.tgz --exclude='*.html' o; el done
