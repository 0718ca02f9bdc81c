#!/bin/bash
# Device call 1 (2 x H200): drafter retraining (two variants, one per GPU) alongside the NCCL + CUDA-graph work.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 QUAL_HANG_DUMP_S=150
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,memory.used --format=csv
for v in A B; do mkdir -p /tmp/$v && cp -r models/toy/target /tmp/$v/; done
mkdir -p $OUT/A $OUT/B $OUT/runs
# --- training: generate once (GPU 0), then A (fresh, target layers 1-4) on GPU 0 and B (warm start) on GPU 1
(
  el gen start
  CUDA_VISIBLE_DEVICES=0 python3 -m qual.toy train --device cuda --out /tmp/A --work .cache/toy --stages generate \
    --set seed=1 --set num_prompts=294912 --set gen_batch=32768 > $OUT/gen.log 2>&1; el gen rc $?
  cp .cache/toy/stats/generate.json $OUT/generate.json
  COMMON="--device cuda --work .cache/toy --stages draft --set seed=1 --set num_prompts=294912 --set gen_batch=32768 --set draft_batch=256 --set draft_seconds=${DRAFT_SECONDS:-330}"
  CUDA_VISIBLE_DEVICES=0 python3 -m qual.toy train --out /tmp/A $COMMON --set shape.target_layer_ids=1,2,3,4 > $OUT/A/train.log 2>&1 &
  CUDA_VISIBLE_DEVICES=1 python3 -m qual.toy train --out /tmp/B $COMMON --set draft_init=$PWD/models/toy/draft --set draft_lr=1e-3 > $OUT/B/train.log 2>&1 &
  wait; el train done
  for v in A B; do cp -r /tmp/$v/draft $OUT/$v/ 2>/dev/null; cp .cache/toy/stats/draft.json $OUT/$v/ 2>/dev/null; done
) &
TRAIN=$!
# draft stats share one work dir: keep each variant's copy as soon as it lands
# --- NCCL + CUDA graphs: the probe, the GPU tests, then qual run --dcp 2 with graphs (replicated / sharded)
el probe; timeout 200 python3 bench/nccl_graph_probe.py --timeout 45 > $OUT/probe.log 2>&1; el probe rc $?
el gputests; timeout 240 python3 -m pytest -q -x tests/test_gpu.py -p no:cacheprovider > $OUT/gputests.log 2>&1; el gputests rc $?
for mode in replicated sharded; do
  el run $mode; timeout 150 python3 -m qual run --dcp 2 --device cuda --limit 32 --draft-kv $mode --out $OUT/runs/$mode --history /tmp/hist.sqlite > $OUT/runs/$mode.log 2>&1; el run $mode rc $?
done
wait $TRAIN
el all done
