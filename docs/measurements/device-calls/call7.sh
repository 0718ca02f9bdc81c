#!/bin/bash
# Device call 7 (1 x H200): where the 0.6B-shape decode step's time goes (bench/profile_decode.py),
# eager vs torch.compile default vs max-autotune-no-cudagraphs.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/p/timeline.log; }
mkdir -p /tmp/p
p() { local name=$1 t=$2; shift 2; el "$name"; timeout $t python3 bench/profile_decode.py --out /tmp/p/$name.json "$@" > /tmp/p/$name.log 2>&1; el "$name rc $?"; }
p eager-b1 90
p default-b1 150 --compile default
p default-b8 120 --batch 8 --compile default
p autotune-b1 ${AUTOTUNE_S:-200} --compile max-autotune-no-cudagraphs
cd /tmp && tar czf $OUT/p.tgz p; el done
