#!/bin/bash
# Device call 8 (2 x H200), the session's last: GPU tests (incl. the Triton kernel and NCCL), the DCP 2
# pass/fail pair with the round-4 drafter, then in parallel: gpu_bench of the 0.6B shape (base, triton,
# compile+triton) on GPU 0; the GEMV comparison + sweep, then the toy and spec rows on GPU 1.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 QUAL_HANG_DUMP_S=60
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/o/timeline.log; }
mkdir -p /tmp/o
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.device_count())" > /tmp/o/env.txt 2>&1
el tests; timeout 170 python3 -m pytest -s -q tests/test_gpu.py -p no:cacheprovider > /tmp/o/gputests.log 2>&1; el tests rc $?
for mode in replicated sharded; do
  el run $mode; timeout 60 python3 -m qual run --dcp 2 --device cuda --limit 32 --draft-kv $mode --out /tmp/o/$mode --history /tmp/hist.sqlite > /tmp/o/$mode.log 2>&1; el run $mode rc $?
done
( CUDA_VISIBLE_DEVICES=1 timeout 130 python3 bench/gemv_bench.py --sweep --out /tmp/o/gemv.json > /tmp/o/gemv.log 2>&1; el gemv rc $?
  CUDA_VISIBLE_DEVICES=1 timeout $(( 540 - $(date +%s) + T0 )) python3 bench/gpu_bench.py --models toy --variants base,compile+triton \
    --out /tmp/o/bench-toy.json > /tmp/o/bench-toy.log 2>&1; el bench-toy rc $? ) &
el bench; CUDA_VISIBLE_DEVICES=0 timeout $(( 545 - $(date +%s) + T0 )) python3 bench/gpu_bench.py --models qwen3-0.6b-shape \
  --variants base,triton,compile+triton --no-spec --out /tmp/o/bench.json > /tmp/o/bench.log 2>&1; el bench rc $?
wait
cd /tmp && tar czf $OUT/o.tgz --exclude='*.html' o; el done
