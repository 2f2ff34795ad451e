#!/usr/bin/env bash
# Ray for the lent GPU machine (Python 3.12, no network, no Ray in its image), small enough to
# carry: the ray 2.60.0 wheel alone is 79 MB, over the 64 MiB a call may carry, so this unpacks
# it with the one dependency tree the image lacks (jsonschema), drops the Java jars and RLlib,
# and packs the result as .whl/ray-site.tar.xz (~31 MB).
# Usage, from the repo root:  bash bench/ray_gpu_wheels.sh
# On the GPU machine:  mkdir -p /tmp/site && tar xJf .whl/ray-site.tar.xz -C /tmp/site
#                      export PYTHONPATH=/tmp/site:$PWD/src
set -euo pipefail
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$WORK/whl" ray==2.60.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
  referencing==0.37.0 rpds-py==2026.9.1
mkdir -p "$WORK/site" .whl
for w in "$WORK"/whl/*.whl; do (cd "$WORK/site" && unzip -q -o "$w"); done
rm -rf "$WORK/site/ray/jars" "$WORK/site/ray/rllib"
tar cf - -C "$WORK/site" . | xz -T2 -7 > .whl/ray-site.tar.xz
ls -la .whl/ray-site.tar.xz
