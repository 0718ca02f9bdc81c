#!/bin/bash
# Device call 5 (2 x H200): round 4 of the toy drafter, two variants in parallel, one per GPU, both grown from
# the committed round-3 drafter (MLP 768 -> 2048; A also reads target layers 1,2,3,4 instead of 1,3),
# fresh generations (seed 3), then the HumanEval eval of each on its GPU.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/r/timeline.log; }
mkdir -p /tmp/r
nvidia-smi --query-gpu=name,memory.used --format=csv > /tmp/r/gpus.txt
variant() {  # name gpu extra-sets...
  local v=$1 gpu=$2; shift 2
  mkdir -p /tmp/r/$v && cp -r models/toy/target /tmp/r/$v/ && cp -r .cache/toy /tmp/w$v
  CUDA_VISIBLE_DEVICES=$gpu timeout ${ROUND_S:-560} python3 -m qual.toy train --device cuda --out /tmp/r/$v --work /tmp/w$v \
    --stages generate,draft,eval --set seed=3 --set num_prompts=196608 --set draft_batch=256 --set draft_lr=1e-3 \
    --set draft_seconds=${DRAFT_S:-360} --set draft_init=$PWD/models/toy/draft --set shape.draft_intermediate_size=2048 \
    "$@" > /tmp/r/$v/train.log 2>&1
  el "$v rc $?"; cp -r /tmp/w$v/stats /tmp/r/$v/
}
el start
variant A 0 --set shape.target_layer_ids=1,2,3,4 &
variant B 1 &
wait
cd /tmp && tar czf $OUT/r.tgz --exclude='target' r; el done
