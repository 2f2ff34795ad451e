#!/usr/bin/env bash
# Unsloth and Axolotl for the lent GPU machine (Python 3.12, torch 2.11+cu130, transformers
# 5.17, no network): the packages they import that the machine lacks, as three site trees in
# one archive, .device-carry/llm-frameworks.tar.xz, which bench/llm_recipes_gpu.sh unpacks into
# /tmp/site-{fwcommon,unsloth,axolotl} and puts on each run's PYTHONPATH.
#
# What goes in was read off real runs, not guessed: each recipe ran here in its own venv
# (scripts/recipe_venv.sh unsloth|axolotl) under PYTHONPROFILEIMPORTTIME=1, and every
# distribution it imported that the GPU image does not hold (device KINDS.md) is listed below,
# at the version that venv resolved. Each framework keeps its own pins apart (Axolotl 0.19 pins
# transformers 5.16.1 / trl 1.9.0 / peft 0.20.0; Unsloth 2026.10.9 needs trl<=1.15 and
# transformers<=5.17, the GPU image's), so the TRL recipes' .whl stack never mixes with them.
#
# Pruned, because one device call carries 64 MiB in all: Unsloth's wheel ships its web UI
# ("studio", 80 MB unpacked, not imported by training); bitsandbytes ships a library per CUDA
# release (the machine's torch is cu130: the cuda130 and cpu ones stay); wandb's bundled
# service binaries (imported by Axolotl, never started: no report_to wandb).
#   bash bench/llm_frameworks_bundle.sh      # -> .device-carry/llm-frameworks.tar.xz
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-/tmp/llm-bundle}
DEST=.device-carry/llm-frameworks.tar.xz
# shellcheck source=bench/_site_bundle.sh
source bench/_site_bundle.sh
COMMON="datasets==4.8.4 dill==0.4.1 multiprocess==0.70.19 bitsandbytes==0.50.2 torchao==0.17.0"
UNSLOTH="unsloth==2026.10.9 unsloth_zoo==2026.10.9 trl==1.15.0 peft==0.21.2"
AXOLOTL="axolotl==0.19.0 axolotl-contribs-lgpl==0.0.7 axolotl-contribs-mit==0.0.6
  transformers==5.16.1 trl==1.9.0 peft==0.20.0 accelerate==1.13.0 addict==2.4.0
  annotated-types==0.8.0 backoff==2.2.1 brotli==1.2.1 chardet==6.0.0.post1 defusedxml==0.7.1
  distro==1.9.0 evaluate==0.4.1 fastcore==2.2.41 google-api-core==2.44.0 google-auth==2.63.0
  google-cloud-core==2.8.0 google-cloud-storage==3.17.1 google-crc32c==1.9.0
  google-resumable-media==2.11.0 googleapis-common-protos==1.76.0 h2==4.4.1 hpack==4.2.0
  hyperframe==6.1.0 kernels==0.16.2 kernels-data==0.16.2 liger_kernel==0.8.1
  mistral_common==1.11.5 opentelemetry-api==1.45.2 opentelemetry-exporter-http-transport==0.66b2
  opentelemetry-exporter-otlp-common==0.66b2 opentelemetry-exporter-otlp-proto-common==1.45.2
  opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-proto==1.45.2
  opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 platformdirs==4.14.9
  posthog==6.7.11 pycountry==26.2.16 pydantic==2.12.5 pydantic_core==2.41.5
  pydantic-extra-types==2.11.1 pytz==2026.6 sniffio==1.3.1 termcolor==3.3.0
  typing-inspection==0.4.5 wandb==0.31.0 zstandard==0.22.0 protobuf==6.33.6"
rm -rf "$WORK"; mkdir -p "$WORK"
# shellcheck disable=SC2086
site_tree fwcommon $COMMON
# shellcheck disable=SC2086
site_tree unsloth $UNSLOTH
# shellcheck disable=SC2086
site_tree axolotl $AXOLOTL
rm -rf "$WORK"/site-unsloth/studio
find "$WORK"/site-fwcommon/bitsandbytes -name 'libbitsandbytes_*.so' \
  ! -name 'libbitsandbytes_cuda130.so' ! -name 'libbitsandbytes_cpu.so' -delete
rm -rf "$WORK"/site-axolotl/wandb/bin
site_pack "$DEST" fwcommon unsloth axolotl
