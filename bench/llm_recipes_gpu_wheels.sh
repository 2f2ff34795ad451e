#!/usr/bin/env bash
# What bench/llm_recipes_gpu.sh needs on the lent GPU machine (Python 3.12, torch 2.11,
# transformers 5.17, peft, accelerate 1.15, no network, no trl/deepspeed/datasets), built here:
#   .device-carry/llm-whl/                 trl 1.16, deepspeed 0.19.8 (+ hjson, pydantic),
#                                          datasets 5.2 (+ dill, multiprocess), and
#                                          transformers 5.24 / peft 0.21.2, liger-kernel 0.8.5, the versions the CPU
#                                          tests use, so the GPU runs the same stack (21 MiB)
#   .device-carry/llm-frameworks.tar.xz    Unsloth and Axolotl trees (bench/llm_frameworks_bundle.sh,
#                                          ~32 MiB; only phase 2 needs it)
# Usage, from the repo root:  bash bench/llm_recipes_gpu_wheels.sh [--no-frameworks]
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.device-carry/llm-whl
PY=${PYTHON:-python3}
rm -rf "$DEST"; mkdir -p "$DEST"
PYTHON="$PY" bash bench/parallel_gpu_wheels.sh "$DEST" >/dev/null   # deepspeed + deps
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST" trl==1.16.0 transformers==5.24.0 peft==0.21.2 datasets==5.2.0 dill==0.4.1 liger-kernel==0.8.5 \
  multiprocess==0.70.19 2>&1 | { grep -v "^WARNING: Location" || true; }
du -sh "$DEST"; ls "$DEST"
[ "${1:-}" = "--no-frameworks" ] || bash bench/llm_frameworks_bundle.sh
