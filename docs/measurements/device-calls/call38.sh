#!/bin/bash
# Session 7, call 38 (1 x H200; carry .whl). Session 6's last code change (workers os._exit(0) after a clean shutdown;
# tests.runtime_helpers.run asserts every worker exits 0) never ran on a GPU. Every one-GPU test, then a toy qual run
# on CUDA (both arms, graphs on) whose exit status and worker exits must be clean.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/q; T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/q/timeline.log; }
el tests; timeout 240 python3 -m pytest -q -rA tests/test_gpu.py -k "not nccl" -p no:cacheprovider > /tmp/q/gputests.log 2>&1; el rc $?
tail -25 /tmp/q/gputests.log
el run; timeout 120 python3 -m qual run --dcp 1 --device cuda --limit 64 --out /tmp/q/toy > /tmp/q/toy.log 2>&1; el rc $?
tail -5 /tmp/q/toy.log
rm -f /tmp/q/toy/*.html; cd /tmp && tar czf $OUT/q.tgz q; el done
