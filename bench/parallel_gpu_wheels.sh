#!/usr/bin/env bash
# Build the wheels that let bench/parallel_gpu.py run ZeRO on the lent GPU machine, which has no
# network and no DeepSpeed (its python3 is 3.12 with torch 2.11; einops, msgpack, ninja,
# py-cpuinfo, psutil, packaging, tqdm, nvidia-ml-py, typing-extensions are already there).
# Usage, from the repo root:  bash bench/parallel_gpu_wheels.sh   -> ./.whl/ (ignored by git)
set -euo pipefail
DEST=${1:-.whl}
mkdir -p "$DEST"
PY=${PYTHON:-python3}
# DeepSpeed ships only an sdist; built without CUDA ops it is a pure-Python wheel (ops JIT on use).
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" deepspeed==0.19.8 2>/dev/null \
  || DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps -w "$DEST" deepspeed==0.19.8
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST" hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
ls -la "$DEST"
