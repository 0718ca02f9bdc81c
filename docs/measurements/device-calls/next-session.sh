#!/bin/bash
# Prepared for the next session (2 x H200 when lent, else 1; carry .whl, which bench/device_wheels.sh rebuilds).
# Not yet run on two GPUs: session 6's worker exit fix (os._exit(0) after a clean shutdown, every worker must exit 0).
# Every GPU test (the NCCL ones skip on one GPU), then the DCP 2
# pass/fail pair of README (the toy profile: eager attention in the graphs).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p /tmp/q; T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/q/timeline.log; }
el tests; timeout 300 python3 -m pytest -q -rA tests/test_gpu.py -p no:cacheprovider > /tmp/q/gputests.log 2>&1; el rc $?
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" /tmp/q/gputests.log | tail -25
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  for kv in replicated sharded; do
    el "dcp2 $kv"; timeout 150 python3 -m qual run --dcp 2 --device cuda --limit 32 --draft-kv $kv --out /tmp/q/dcp2-$kv \
      > /tmp/q/dcp2-$kv.log 2>&1; el rc $?; tail -6 /tmp/q/dcp2-$kv.log
  done
fi
rm -f /tmp/q/*/report.html; cd /tmp && tar czf $OUT/q.tgz q; el done
