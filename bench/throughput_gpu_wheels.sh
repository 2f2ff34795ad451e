#!/usr/bin/env bash
# Build the wheels that bench/gpu_throughput.py and bench/gpu_profile.py need on the lent GPU
# machine, which has no network: torchao for the fp8 rows, DeepSpeed (and its pure-Python
# dependencies) for the zero2 row.
#
# torchao 0.17.0 is the release built against torch 2.11 (the GPU host's torch 2.11+cu130):
# torchao 0.16.0's own compatibility table (torchao/__init__.py) pairs 0.16.0 with torch 2.10.0
# and 2.11.0.dev, and 0.17.0's import check requires torch >= 2.11.0 for its compiled extensions.
# Its float8 training path (torchao.float8) is Python + triton and does not load them.
# Usage, from the repo root:  bash bench/throughput_gpu_wheels.sh   -> ./.whl/ (ignored by git)
set -euo pipefail
DEST=${1:-.whl}
mkdir -p "$DEST"
PY=${PYTHON:-python3}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST" torchao==0.17.0
bash "$(dirname "$0")/parallel_gpu_wheels.sh" "$DEST"   # deepspeed 0.19.8 and its dependencies
ls -la "$DEST"
du -sh "$DEST"
