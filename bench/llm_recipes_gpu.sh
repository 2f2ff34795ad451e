#!/usr/bin/env bash
# The LLM recipes on the lent H200 at real sequence length (issue 19), in two device calls of
# at most 8 minutes each (bench/llm_recipes_gpu.py says what each phase runs):
#   PHASE=1 bash bench/llm_recipes_gpu.sh   # TRL launcher parity; carry .device-carry/llm-whl
#   PHASE=2 bash bench/llm_recipes_gpu.sh   # real-shape rows; carry .device-carry/llm-whl and
#                                           # .device-carry/llm-frameworks.tar.xz
#   SMOKE=1 PHASE=1 PY=<venv>/bin/python bash bench/llm_recipes_gpu.sh   # the same plan on CPU,
#       tiny models (phase 2 also takes LLM_PYTHON_UNSLOTH / LLM_PYTHON_AXOLOTL: their venvs)
# Build what is carried first, here:  bash bench/llm_recipes_gpu_wheels.sh
# Each call is self-contained (a cold machine is fine); on a warm one the installs are reused.
# Writes $OUT/summary-phase<N>.{json,md}, logs-phase<N>.tar.gz, driver-phase<N>.log.
set -uo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
OUT=${OUT:-$PWD/out-llm}; PHASE=${PHASE:-1}
mkdir -p "$OUT"
site_install() {  # wheels dir -> /tmp/site (skipped when this exact set is there already)
  local stamp; stamp=$(ls "$1" | sha256sum | cut -c1-16)
  [ "$(cat /tmp/site/.llm-stamp 2>/dev/null)" = "$stamp" ] && return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$1"/*.whl && echo "$stamp" > /tmp/site/.llm-stamp
}
if [ -z "${SMOKE:-}" ]; then
  if [ -d .device-carry/llm-whl ]; then
    site_install .device-carry/llm-whl || { echo "installing the TRL stack failed"; exit 1; }
  fi
  export LLM_SITE_TRL=/tmp/site
  if [ "$PHASE" = 2 ]; then
    if [ -f .device-carry/llm-frameworks.tar.xz ] && [ ! -d /tmp/site-axolotl ]; then
      tar -C /tmp -xJf .device-carry/llm-frameworks.tar.xz || echo "unpacking the frameworks failed"
    fi
    export LLM_SITE_UNSLOTH=/tmp/site-unsloth:/tmp/site-fwcommon
    export LLM_SITE_AXOLOTL=/tmp/site-axolotl:/tmp/site-fwcommon
  fi
else
  export GPULAUNCH_FORCE_CPU=1
fi
echo "installs: $(( $(date +%s) - t0 )) s"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export GPULAUNCH_HOME=/tmp/gpulaunch-home GPULAUNCH_TRACKING=0 TORCH_EXTENSIONS_DIR=/tmp/torch-ext
export GPULAUNCH_LLM_DATA_CACHE=/tmp/llm-data HF_HOME=/tmp/hf-home AXOLOTL_DO_NOT_TRACK=1
export UNSLOTH_DISABLE_STATISTICS=1 WANDB_MODE=disabled
# this workplace's GPU hosts keep NVLink multicast off (device KINDS.md)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# the whole call must end inside the device's 8 minutes: the runs get what is left
total=${TOTAL_S:-460}; [ -n "${SMOKE:-}" ] && total=${TOTAL_S:-7200}
budget=$(( total - ($(date +%s) - t0) ))
"${PY:-python3}" bench/llm_recipes_gpu.py --phase "$PHASE" ${SMOKE:+--smoke} --budget-s "$budget" \
  --out "$OUT" ${ONLY:+--only "$ONLY"} 2>&1 | tee "$OUT/driver-phase$PHASE.log"
echo "phase $PHASE done in $(( $(date +%s) - t0 )) s"
