#!/bin/bash
# Prepared, not yet run (written at the end of the third session, whose device time was spent):
# the GPU tests of the Triton paged-attention kernel, then the 0.6B-shape step with it.
# 1 x H200 is enough. Carry .whl (datasets/dill/multiprocess wheels for Python 3.12).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/n
timeout 150 python3 -m pytest -s -q tests/test_gpu.py -k "not nccl" -p no:cacheprovider > /tmp/n/gputests.log 2>&1
timeout 90 python3 bench/profile_decode.py --compile default --triton-gemm --triton-attention --out /tmp/n/prof.json > /tmp/n/prof.log 2>&1
timeout 300 python3 bench/gpu_bench.py --models qwen3-0.6b-shape --variants base,compile+triton,compile+triton+attn --no-spec \
  --out /tmp/n/bench.json > /tmp/n/bench.log 2>&1
cd /tmp && tar czf $OUT/n.tgz n
