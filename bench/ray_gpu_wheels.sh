#!/usr/bin/env bash
# Wheels that let bench/ray_multinode.py --gpu run on the lent GPU machine (Python 3.12, no
# network, no Ray). Usage, from the repo root:  bash bench/ray_gpu_wheels.sh  -> ./.whl/ray/
# On the GPU machine:  pip install --no-index --find-links .whl/ray ray==2.60.0
set -euo pipefail
DEST=${1:-.whl/ray}
mkdir -p "$DEST"
PY=${PYTHON:-python3}
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST" ray==2.60.0
ls -la "$DEST"
du -sh "$DEST"
