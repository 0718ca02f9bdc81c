#!/bin/bash
# Device call 3 (1 x H200): continue drafter B (warm start) on fresh data (seed 2), solo on the GPU.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a $OUT/timeline.log; }
mkdir -p /tmp/C && cp -r models/toy/target /tmp/C/
DATA="--set seed=2 --set num_prompts=196608"
el gen; python3 -m qual.toy train --device cuda --out /tmp/C --work .cache/toy --stages generate $DATA > $OUT/train.log 2>&1; el gen rc $?
python3 -m qual.toy train --device cuda --out /tmp/C --work .cache/toy --stages draft $DATA --set draft_batch=256 \
  --set draft_seconds=${DRAFT_SECONDS:-360} --set draft_init=$PWD/.device/B/draft --set draft_lr=1e-3 >> $OUT/train.log 2>&1; el train rc $?
cd /tmp && cp -r $OLDPWD/.cache/toy/stats /tmp/C/stats; tar czf $OUT/C.tgz C/draft C/stats
el done
