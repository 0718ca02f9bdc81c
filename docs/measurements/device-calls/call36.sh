#!/bin/bash
# Session 6, call 36 (1 x H200; carry .whl .device): what the graphs' static key width costs a GPU qual run. The toy
# pair, DCP 1 in both arms, CUDA graphs, 64 HumanEval prompts: max_model_len 2048 (the default; the eager attention in
# the graphs reads all 2,048 keys), 256, and 2048 with the Triton paged attention (reads only each row's keys).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/q; T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a /tmp/q/timeline.log; }
sed 's/^name: toy$/name: toy256/' configs/models/toy.yaml > configs/models/toy256.yaml; echo "max_model_len: 256" >> configs/models/toy256.yaml
sed 's/^name: toy$/name: toyattn/' configs/models/toy.yaml > configs/models/toyattn.yaml
printf 'reference:\n  triton_attention: true\n' >> configs/models/toyattn.yaml
for m in toy toy256 toyattn; do
  el "run $m"; s=$(date +%s.%N)
  timeout 170 python3 -m qual run --model $m --dcp 1 --device cuda --limit 64 --out /tmp/q/$m > /tmp/q/$m.log 2>&1; rc=$?
  el "rc $rc wall $(python3 -c "print(round($(date +%s.%N) - $s, 1))") s"
done
cd /tmp && tar czf $OUT/q.tgz q; el done
