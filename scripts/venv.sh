#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and print its path.
# GPULAUNCH_VENV picks the location (default: .venv in the repository); the environment is
# rebuilt only when the dependency files change (their hash is stored inside it).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${GPULAUNCH_VENV:-$repo/.venv}"
extras="${GPULAUNCH_EXTRAS-test}"     # set but empty: no extra (the demo)
# torch 2.14.1 + torchvision 0.29.1: the CUDA build, which also runs on CPU (RetinaNet recipe
# needs torchvision). Override with TORCH_SPEC, e.g. TORCH_SPEC="torch==2.13.0" (CPU only).
torch_spec="${TORCH_SPEC:-torch==2.14.1 torchvision==0.29.1}"
# The versions the test suite was last run green with (pip freeze of that environment): a fresh
# machine gets the same stack instead of whatever was released since. GPULAUNCH_CONSTRAINTS=""
# installs the newest that pyproject.toml allows.
constraints="${GPULAUNCH_CONSTRAINTS-$repo/scripts/constraints.txt}"
# TorchRec (the Lightning two-tower recipe's embedding tables), with the test extra: its wheel
# pins torchmetrics==1.0.3 and the CUDA fbgemm-gpu, which would break Lightning's torchmetrics
# and download gigabytes. TorchRec without those pins plus fbgemm's CPU build work with this
# torch (tests/recipes/test_recipes.py trains the recipe with it), so they go in with --no-deps.
# GPULAUNCH_TORCHREC=0 leaves them out.
torchrec_spec=""
if [ "${GPULAUNCH_TORCHREC:-1}" != 0 ] && [[ ",$extras," == *,test,* ]]; then
  torchrec_spec="torchrec==1.9.2 fbgemm-gpu-cpu==1.9.0 tensordict==0.15.3 pyvers==0.2.3 pyre-extensions==0.0.32 typing-inspect==0.9.0 mypy-extensions==1.2.0"
fi
key="$( (cat "$repo/pyproject.toml" ${constraints:+"$constraints"}; echo "$extras $torch_spec $torchrec_spec") | sha256sum | cut -c1-16)"
if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.gpulaunch-key" 2>/dev/null)" = "$key" ]; then
  # dependencies unchanged: only make sure the checkout itself is the one installed
  "$venv/bin/python" -m pip install -q --no-deps -e "$repo" 2>&1 | grep -v "^WARNING: Location" >&2 || true
  echo "$venv"; exit 0
fi
rm -rf "$venv"
python3 -m venv "$venv"
quiet() { grep -v "^WARNING: Location" >&2 || true; }  # local package mirrors are noisy
"$venv/bin/python" -m pip install -q --upgrade pip 2>&1 | quiet
# shellcheck disable=SC2086
"$venv/bin/python" -m pip install -q $torch_spec 2>&1 | quiet
"$venv/bin/python" -m pip install -q ${constraints:+-c "$constraints"} -e "$repo${extras:+[$extras]}" 2>&1 | quiet
if [ -n "$torchrec_spec" ]; then
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install -q --no-deps $torchrec_spec 2>&1 | quiet
  "$venv/bin/python" -c "import torchrec"
fi
"$venv/bin/python" -c "import gpulaunch, torch" # fail here, clearly, if the install did not work
echo "$key" > "$venv/.gpulaunch-key"
echo "$venv"
