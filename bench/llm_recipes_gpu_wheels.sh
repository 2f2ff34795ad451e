#!/usr/bin/env bash
# Wheels that let bench/llm_recipes_gpu.sh run on the lent GPU machine (Python 3.12, torch 2.11,
# transformers 5.17, peft, accelerate 1.15, no network, no trl/deepspeed/datasets). transformers
# and peft are carried at the versions the CPU tests use (5.24.0 / 0.21.2), so the GPU runs the
# same stack. Usage, from the repo root:  bash bench/llm_recipes_gpu_wheels.sh  -> ./.whl/ (~21 MiB)
set -euo pipefail
DEST=${1:-.whl}
PY=${PYTHON:-python3}
PYTHON="$PY" bash "$(dirname "$0")/parallel_gpu_wheels.sh" "$DEST" >/dev/null   # deepspeed + deps
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST" trl==1.16.0 transformers==5.24.0 peft==0.21.2 datasets==5.2.0 dill==0.4.1 \
  multiprocess==0.70.19
du -sh "$DEST"; ls "$DEST"
