#!/bin/bash
# Prepared for the next session (1 x H200; carry .whl). Session 5's last change (the Triton paged attention stops
# at KeyView.lengths) ran its kernel tests and the benchmark on the GPU (call 30), but
# test_triton_kernels_in_graphs_equal_them_eager[attention] did not run (time ran out). Run every one-GPU test first.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/q; T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/q/timeline.log; }
el tests; timeout 240 python3 -m pytest -q -rA tests/test_gpu.py -k "not nccl" -p no:cacheprovider > /tmp/q/gputests.log 2>&1; el rc $?
cd /tmp && tar czf $OUT/q.tgz q; el done
