#!/usr/bin/env bash
# bench/llm_speed.py on the lent GPU, one group per device call (each fits 10 minutes):
#   GROUP=lora    bash bench/llm_speed.sh   # LoRA anchor A .. recipes, fused by hand .. A
#   GROUP=full    bash bench/llm_speed.sh   # full anchor A .. ZeRO-3 fast/plain x gpulaunch/accelerate .. A
#   GROUP=quality bash bench/llm_speed.sh   # LoRA recipes --speed off (the eval-loss baseline)
#   GROUP=table TOTAL_S=580 bash bench/llm_speed.sh   # the speed table's ten rows alone
#                                       # (~490 s on an H200; a slow H100 host needs ~660 s)
#   GROUP=frameworks bash bench/llm_speed.sh  # Unsloth vs TRL LoRA, Llama-3.2-3B (also carry
#                                             # .device-carry/llm-frameworks.tar.xz)
#   GROUP=gptoss TOTAL_S=400 bash bench/llm_speed.sh   # gpt-oss-20b: the seed's row vs --speed auto (+ variants)
#   GROUP=qlora TOTAL_S=560 bash bench/llm_speed.sh    # Axolotl vs TRL QLoRA, OLMo-3-7B (also carry
#                                                      # .device-carry/llm-frameworks.tar.xz)
#   GROUP=foundry bash bench/llm_speed.sh   # LLM Foundry vs TRL full, Llama-3.2-1B (also carry
#                                           # .device-carry/llm-foundry.tar.xz, not the frameworks')
# Carry .device-carry/llm-whl (bash bench/llm_recipes_gpu_wheels.sh --no-frameworks, here) and
# .device-carry/anchors (python3 bench/llm_speed.py --carry, here).
# Writes $OUT/llm_speed.{json,md}, $OUT/llm-speed-logs.tar.gz, $OUT/driver.log.
set -uo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
OUT=${OUT:-$PWD/out-llm-speed}; GROUP=${GROUP:-lora}
mkdir -p "$OUT"
if [ -d .device-carry/llm-whl ]; then
  stamp=$(ls .device-carry/llm-whl | sha256sum | cut -c1-16)
  if [ "$(cat /tmp/site/.llm-stamp 2>/dev/null)" != "$stamp" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .device-carry/llm-whl/*.whl && echo "$stamp" > /tmp/site/.llm-stamp \
      || { echo "installing the TRL stack failed"; exit 1; }
  fi
fi
if [ -f .device-carry/llm-frameworks.tar.xz ] && [ ! -d /tmp/site-unsloth ]; then
  tar -C /tmp -xJf .device-carry/llm-frameworks.tar.xz || echo "unpacking the frameworks failed"
fi
# LLM Foundry's tree (bench/llm_foundry_bundle.sh): alone on its runs' PYTHONPATH, in front of
# the machine's own packages (its transformers 4.51.3 shadows the machine's 5.17)
if [ -f .device-carry/llm-foundry.tar.xz ] && [ ! -d /tmp/site-foundry ]; then
  tar -C /tmp -xJf .device-carry/llm-foundry.tar.xz || echo "unpacking LLM Foundry failed"
fi
[ -d /tmp/site-foundry ] && export LLM_SITE_FOUNDRY=/tmp/site-foundry
export LLM_SITE_UNSLOTH=/tmp/site-unsloth:/tmp/site-fwcommon
[ -d /tmp/site-axolotl ] && export LLM_SITE_AXOLOTL=/tmp/site-axolotl:/tmp/site-fwcommon
# the TRL QLoRA row: the TRL stack plus bitsandbytes alone, linked out of the bundle's common
# tree (not the whole tree: its datasets 4.8 and torchao would sit beside the TRL stack's)
if [ -d /tmp/site-fwcommon/bitsandbytes ]; then
  mkdir -p /tmp/site-bnb
  ln -sfn /tmp/site-fwcommon/bitsandbytes /tmp/site-bnb/bitsandbytes
  for d in /tmp/site-fwcommon/bitsandbytes-*.dist-info; do ln -sfn "$d" /tmp/site-bnb/; done
  export LLM_SITE_TRL_QLORA=/tmp/site:/tmp/site-bnb
fi
export LLM_SITE_TRL=/tmp/site PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
echo "installs: $(( $(date +%s) - t0 )) s"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export GPULAUNCH_HOME=/tmp/gpulaunch-home GPULAUNCH_TRACKING=0 TORCH_EXTENSIONS_DIR=/tmp/torch-ext
export GPULAUNCH_LLM_DATA_CACHE=/tmp/llm-data HF_HOME=/tmp/hf-home WANDB_MODE=disabled
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
total=${TOTAL_S:-560}
budget=$(( total - ($(date +%s) - t0) ))
python3 bench/llm_speed.py --group "$GROUP" --budget-s "$budget" --out "$OUT" ${ONLY:+--only "$ONLY"} \
  2>&1 | tee "$OUT/driver.log"
tar -C /tmp -czf "$OUT/llm-speed-logs.tar.gz" llm-speed-logs 2>/dev/null
echo "group $GROUP done in $(( $(date +%s) - t0 )) s"
