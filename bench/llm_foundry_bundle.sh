#!/usr/bin/env bash
# LLM Foundry 0.22.0 + composer 0.32.1 without an environment of their own: one site tree of
# their pure-Python code and the packages they import that the lent GPU machine lacks, put on
# PYTHONPATH in front of that machine's own packages (Python 3.12, torch 2.11, no network).
# Foundry and composer pin torch<2.7.1 in their metadata; installed with --no-deps they run on a
# newer torch (trained on CPU here with torch 2.14.1: recipes/LLM.md). No torch, torchvision,
# numpy, pandas, pyarrow, accelerate, peft, safetensors or requests go in: the GPU image has them.
#
#   bash bench/llm_foundry_bundle.sh              # -> .device-carry/llm-foundry.tar.xz, which
#                                                 #    bench/llm_speed.sh unpacks to /tmp/site-foundry
#   bash bench/llm_foundry_bundle.sh --here [DIR] # the same tree for this interpreter, in DIR
#       (default ~/.cache/gpulaunch/sites/llmfoundry-py<X.Y>: what the CPU test looks for)
#
# What goes in was read off real runs, not guessed: the recipe's CPU command (recipes/LLM.md)
# ran with every package of this machine's venv that the GPU image does not hold (device
# KINDS.md) made unimportable, and each import that then failed added its distribution here.
# The versions are Foundry's own resolution where it pins one (transformers 4.51.3, datasets
# 3.6.0, huggingface-hub < 0.34, mlflow 2.22, GitPython 3.1.44, streaming 0.12) and what
# datasets 3.6 needs (dill 0.3.8, multiprocess 0.70.16; a newer dill breaks its fingerprints).
# mlflow is imported by Foundry's checkpointer and config code even with no MLflow logger, and
# it pulls databricks-sdk, google-auth, pydantic and opentelemetry in at import time.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-/tmp/foundry-bundle}
DEST=.device-carry/llm-foundry.tar.xz
HERE_DIR=
if [ "${1:-}" = --here ]; then
  export SITE_FOR=here
  HERE_DIR=${2:-$HOME/.cache/gpulaunch/sites/llmfoundry-py$("${PYTHON:-python3}" -c \
    'import sys; print("%d.%d" % sys.version_info[:2])')}
fi
# shellcheck source=bench/_site_bundle.sh
source bench/_site_bundle.sh
FOUNDRY="llm-foundry==0.22.0 mosaicml==0.32.1 mosaicml-cli==0.7.5 mosaicml-streaming==0.12.0
  transformers==4.51.3 tokenizers==0.21.4 huggingface-hub==0.33.5 datasets==3.6.0
  fsspec==2025.3.0 dill==0.3.8 multiprocess==0.70.16 omegaconf==2.4.0
  antlr4-python3-runtime==4.9.3 catalogue==2.0.10 coolname==5.0.0 backoff==2.2.1 gql==4.4.0
  graphql-core==3.3.2 tenacity==9.2.1 websockets==17.4 ruamel.yaml==0.19.1 questionary==2.1.1
  prompt-toolkit==3.0.53 wcwidth==0.9.5 validators==0.36.0 brotli==1.2.1 python-snappy==0.7.3
  cramjam==2.14.0 zstd==1.5.6.1 setuptools==80.10.2 importlib-metadata==8.9.0
  gitpython==3.1.44 gitdb==4.0.12 smmap==5.0.3 beautifulsoup4==4.15.0 platformdirs==4.14.9
  mlflow-skinny==2.22.5 databricks-sdk==0.55.0 google-auth==2.40.3 rsa==4.9.1 pyasn1==0.6.5
  pyasn1-modules==0.4.2 cachetools==8.0.3 sqlparse==0.6.1 opentelemetry-api==1.45.2
  opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5"
# setuptools < 81: Foundry's environment logger imports pkg_resources, which 81 removed.
# Here only: tabulate, which the GPU image has and this machine's venv does not.
HERE_ONLY="tabulate==0.9.0"
rm -rf "$WORK"; mkdir -p "$WORK"
# shellcheck disable=SC2086
site_tree foundry $FOUNDRY ${HERE_DIR:+$HERE_ONLY}
if [ -n "$HERE_DIR" ]; then
  rm -rf "$HERE_DIR"; mkdir -p "$(dirname "$HERE_DIR")"
  rm -rf "$WORK/site-foundry/bin"; mv "$WORK/site-foundry" "$HERE_DIR"
  du -sh "$HERE_DIR"
  exit 0
fi
site_pack "$DEST" foundry
