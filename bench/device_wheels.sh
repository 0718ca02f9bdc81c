#!/bin/bash
# Fills .whl/ (git-ignored) with what the H200 image lacks for `import qual`: datasets and the two packages of its
# that the image does not hold. Run here, in the repository root, once per checkout; device calls then carry .whl
# and begin with the install line of docs/measurements/device-calls/call38.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "datasets==5.2.0" "dill==0.4.1" "multiprocess==0.70.19"
ls .whl
