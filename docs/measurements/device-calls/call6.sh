#!/bin/bash
# Device call 6 (1 x H200): GPU tests (graphs equal eager, also compiled), then gpu_bench with --compile
# (the operator cuts, the round-4 drafter, and the torch.compile'd decode step).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/b/timeline.log; }
mkdir -p /tmp/b
el tests; timeout 150 python3 -m pytest -s -q -x tests/test_gpu.py -p no:cacheprovider > /tmp/b/gputests.log 2>&1; el tests rc $?
el bench; timeout ${BENCH_S:-400} python3 bench/gpu_bench.py --out /tmp/b/bench.json --compile > /tmp/b/bench.log 2>&1; el bench rc $?
cd /tmp && tar czf $OUT/b.tgz b; el done
