#!/bin/bash
# Device call 2 (1 x H200): drafter retraining A/B (both on the one GPU) + eval, GPU tests, then gpu_bench with the better drafter.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 QUAL_HANG_DUMP_S=100 PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a $OUT/timeline.log; }
mkdir -p $OUT/A $OUT/B
for v in A B; do mkdir -p /tmp/$v && cp -r models/toy/target /tmp/$v/; done
DATA="--set seed=1 --set num_prompts=196608"
(
  el gen start
  python3 -m qual.toy train --device cuda --out /tmp/A --work .cache/toy --stages generate $DATA > $OUT/gen.log 2>&1; el gen rc $?
  cp .cache/toy/stats/generate.json $OUT/
  for v in A B; do cp -r .cache/toy /tmp/w$v; done
  COMMON="--device cuda --stages draft,eval $DATA --set draft_batch=256 --set draft_seconds=${DRAFT_SECONDS:-220}"
  python3 -m qual.toy train --out /tmp/A --work /tmp/wA $COMMON --set shape.target_layer_ids=1,2,3,4 > $OUT/A/train.log 2>&1 &
  python3 -m qual.toy train --out /tmp/B --work /tmp/wB $COMMON --set draft_init=$PWD/models/toy/draft --set draft_lr=1e-3 > $OUT/B/train.log 2>&1 &
  wait; el train done
  for v in A B; do cp -r /tmp/$v/draft $OUT/$v/; cp /tmp/w$v/stats/draft.json /tmp/w$v/stats/eval.json $OUT/$v/; done
) &
TRAIN=$!
el gputests; timeout 120 python3 -m pytest -s -q -x tests/test_gpu.py -p no:cacheprovider > $OUT/gputests.log 2>&1; el gputests rc $?
wait $TRAIN
BEST=$(python3 -c "
import json,sys
r={v: json.load(open('$OUT/'+v+'/eval.json'))['acceptance_rate'] for v in 'AB'}
print(max(r,key=r.get))" 2>/dev/null)
el "evals: best=$BEST"
if [ -n "$BEST" ]; then cp -r /tmp/$BEST/draft/* models/toy/draft/; fi
el bench; timeout 150 python3 bench/gpu_bench.py --out $OUT/bench.json > $OUT/bench.log 2>&1; el bench rc $?
el all done
