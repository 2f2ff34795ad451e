#!/usr/bin/env bash
# Build (or reuse) the separate environment of a recipe whose framework would change the main
# environment's versions, and print its path. Cached: rebuilt only when the spec below changes.
#   scripts/recipe_venv.sh unsloth   # Unsloth 2026.10.9 (+ its transformers/trl), ~6.4 GB, ~5 min
#   scripts/recipe_venv.sh axolotl   # Axolotl 0.19.0 (last for Python 3.11), torch 2.13, ~7.3 GB
# Location: $GPULAUNCH_RECIPE_VENVS/<name> (default ~/.cache/gpulaunch/venvs/<name>). Tests of
# these recipes run only where the environment already exists (they never build it).
# LLM Foundry is not offered: every llm-foundry/composer release pins torch<2.7.1 (see
# recipes/LLM.md).
set -euo pipefail
name=${1:?usage: scripts/recipe_venv.sh unsloth|axolotl}
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case "$name" in
  # Unsloth refuses to import beside a torchvision that does not match torch: take the pair.
  unsloth) spec="unsloth==2026.10.9"; torch_spec="${TORCH_SPEC:-torch==2.14.1 torchvision==0.29.1}" ;;
  # Axolotl 0.19 resolves torch down to 2.13.0 (CPU build here); no torchvision (not needed,
  # and PyPI's does not load beside that torch).
  axolotl) spec="axolotl==0.19.0"; torch_spec="${TORCH_SPEC:-torch==2.13.0}" ;;
  *) echo "unknown recipe environment '$name' (unsloth, axolotl)" >&2; exit 2 ;;
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
