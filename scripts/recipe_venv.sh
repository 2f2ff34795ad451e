#!/usr/bin/env bash
# Build (or reuse) the separate environment of a recipe whose framework would change the main
# environment's versions, and print its path. Cached: rebuilt only when the spec below changes.
#   scripts/recipe_venv.sh unsloth   # Unsloth 2026.10.9 (+ its transformers/trl), ~6.4 GB, ~5 min
#   scripts/recipe_venv.sh axolotl   # Axolotl 0.19.0 (last for Python 3.11), torch 2.13, ~7.3 GB
#   scripts/recipe_venv.sh llmfoundry  # llm-foundry 0.22.0 + composer 0.32.1, torch 2.7.0 (their pin)
# Location: $GPULAUNCH_RECIPE_VENVS/<name> (default ~/.cache/gpulaunch/venvs/<name>). Tests of
# these recipes run only where the environment already exists (they never build it).
# LLM Foundry: every llm-foundry and mosaicml composer release pins torch<2.7.1, so its
# environment takes torch 2.7.0 (the newest they accept) and torchvision 0.22.0. Where a
# machine-wide pip constraint caps torch (a `constraint` in /etc/xdg/pip/pip.conf), this one
# build runs with PIP_CONSTRAINT=/dev/null: pip's environment variables replace its config
# files' values, so the cap's file gives way to an empty one here and stays for everything
# else. (An empty PIP_CONSTRAINT= does not: pip ignores empty variables. Checked with pip 23.2
# and 26.3 and a pip.conf pinning torch==2.14.1: refused when empty, resolved with /dev/null.)
set -euo pipefail
name=${1:?usage: scripts/recipe_venv.sh unsloth|axolotl|llmfoundry}
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case "$name" in
  # Unsloth refuses to import beside a torchvision that does not match torch: take the pair.
  unsloth) spec="unsloth==2026.10.9"; torch_spec="${TORCH_SPEC:-torch==2.14.1 torchvision==0.29.1}" ;;
  # Axolotl 0.19 resolves torch down to 2.13.0 (CPU build here); no torchvision (not needed,
  # and PyPI's does not load beside that torch).
  axolotl) spec="axolotl==0.19.0"; torch_spec="${TORCH_SPEC:-torch==2.13.0}" ;;
  # torchvision 0.22.0 is the one built against torch 2.7.0 (composer requires torchvision).
  llmfoundry) spec="llm-foundry==0.22.0 mosaicml==0.32.1"
              torch_spec="${TORCH_SPEC:-torch==2.7.0 torchvision==0.22.0}"
              export PIP_CONSTRAINT=/dev/null ;;
  *) echo "unknown recipe environment '$name' (unsloth, axolotl, llmfoundry)" >&2; exit 2 ;;
esac
venv="${GPULAUNCH_RECIPE_VENVS:-$HOME/.cache/gpulaunch/venvs}/$name"
key="$(echo "$torch_spec $spec cloudpickle psutil" | sha256sum | cut -c1-16)"
if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.gpulaunch-key" 2>/dev/null)" = "$key" ]; then
  echo "$venv"; exit 0
fi
rm -rf "$venv"; mkdir -p "$(dirname "$venv")"
python3 -m venv "$venv"
quiet() { grep -v "^WARNING: Location" >&2 || true; }
"$venv/bin/python" -m pip install -q --upgrade pip 2>&1 | quiet
# shellcheck disable=SC2086
"$venv/bin/python" -m pip install -q $torch_spec 2>&1 | quiet
"$venv/bin/python" -m pip install -q $spec "cloudpickle>=2.2" "psutil>=5.9" 2>&1 | quiet
"$venv/bin/python" -m pip install -q --no-deps -e "$repo" 2>&1 | quiet   # gpulaunch itself
echo "$key" > "$venv/.gpulaunch-key"
echo "$venv"
