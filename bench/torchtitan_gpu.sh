#!/usr/bin/env bash
# torchtitan's trainer vs prepare() at Llama-3 8B width on one GPU (bench/torchtitan_gpu.py says
# what each side runs). One device call per precision keeps each call inside the 10 minutes:
#   PRECISIONS=bf16 bash bench/torchtitan_gpu.sh     # carry .device-carry/titan-whl
#   PRECISIONS=fp8  bash bench/torchtitan_gpu.sh
#   ROUNDS=1 PRECISIONS=bf16,fp8 bash bench/torchtitan_gpu.sh   # one interleaved round of each, one call
#   SMOKE=1 PY=<venv>/bin/python bash bench/torchtitan_gpu.sh   # here, on CPU: --dry-run, tiny shapes
# Build what is carried first, here:  bash bench/torchtitan_gpu_wheels.sh
# Writes $OUT/torchtitan-<precisions>.json and driver-<precisions>.log.
set -uo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
OUT=${OUT:-$PWD/out-titan}; PRECISIONS=${PRECISIONS:-bf16,fp8}
mkdir -p "$OUT"
if [ -z "${SMOKE:-}" ] && [ -d .device-carry/titan-whl ]; then
  stamp=$(ls .device-carry/titan-whl | sha256sum | cut -c1-16)
  if [ "$(cat /tmp/site-titan/.stamp 2>/dev/null)" != "$stamp" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site-titan .device-carry/titan-whl/*.whl && echo "$stamp" > /tmp/site-titan/.stamp \
      || { echo "installing torchtitan's wheels failed"; exit 1; }
  fi
  export PYTHONPATH=/tmp/site-titan${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 GPULAUNCH_TRACKING=0 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
total=${TOTAL_S:-560}
budget=$(( total - ($(date +%s) - t0) ))
tag=${PRECISIONS//,/-}
"${PY:-python3}" bench/torchtitan_gpu.py --precisions "$PRECISIONS" --budget-s "$budget" \
  ${SMOKE:+--dry-run} ${LAYERS:+--layers "$LAYERS"} ${RECIPE:+--fp8-recipe "$RECIPE"} \
  ${ROUNDS:+--rounds "$ROUNDS"} ${STEPS:+--steps "$STEPS"} \
  --out "$OUT/torchtitan-$tag.json" 2>&1 | tee "$OUT/driver-$tag.log"
rc=${PIPESTATUS[0]}
echo "done in $(( $(date +%s) - t0 )) s (exit $rc)"
exit "$rc"
