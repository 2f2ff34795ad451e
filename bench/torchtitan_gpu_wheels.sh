#!/usr/bin/env bash
# Build .device-carry/titan-whl/: what bench/torchtitan_gpu.sh needs on the lent GPU machine
# (Python 3.12, torch 2.11, no network; it has einops, fsspec, rich, safetensors, tensorboard,
# pyarrow, pandas, xxhash, huggingface-hub, tokenizers, pillow, requests, filelock already).
# torchtitan 0.2.2: the release that imports with torch 2.11 (0.3.0 needs DataParallelMeshDims
# from a newer torch); torchao 0.17.0: the one built for torch 2.11. ~5 MB in all.
#   bash bench/torchtitan_gpu_wheels.sh      # then carry .device-carry/titan-whl
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.device-carry/titan-whl}
PY=${PYTHON:-/root/.cache/gpulaunch-ci/venv/bin/python}
[ -x "$PY" ] || PY=python3
mkdir -p "$DEST"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$DEST" \
  torchtitan==0.2.2 torchao==0.17.0 torchdata==0.11.0 tyro==1.0.17 docstring-parser==0.18.0 \
  typeguard==4.6.1 shtab==1.13.0 tomli==2.5.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
ls -la "$DEST"
du -sh "$DEST"
