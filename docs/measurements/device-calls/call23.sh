#!/bin/bash
# Export call 22's Nsight Compute report by Python source line (cuda = the Triton source via line info).
mkdir -p /tmp/q
for src in cuda "cuda,sass"; do
  ncu -i .device/c22.ncu-rep --page source --csv --print-source "$src" > "/tmp/q/source-${src/,/-}.csv" 2>&1; echo "$src rc $?"
done
ncu -i .device/c22.ncu-rep --page source --csv --print-source cuda --resolve-source-file qual/runtime/kernels/decode_layers.py > /tmp/q/source-resolved.csv 2>&1; echo "resolved rc $?"
ls -la /tmp/q; cd /tmp && tar czf $OUT/q.tgz q
