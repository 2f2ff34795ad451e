#!/usr/bin/env bash
# Set up the environment if needed, then run the quickstart on every GPU here (or 2 CPU workers).
# The demo's own environment (.venv-demo): torch and gpulaunch's core dependencies only, not the
# test suite's extras (./scripts/test.sh builds .venv with those); numpy, or torch warns at import.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(GPULAUNCH_VENV="${GPULAUNCH_VENV:-$repo/.venv-demo}" GPULAUNCH_EXTRAS="${GPULAUNCH_EXTRAS-}" \
        TORCH_SPEC="${TORCH_SPEC:-torch==2.14.1 numpy}" "$repo/scripts/venv.sh")"
cd "$repo"
exec "$venv/bin/python" recipes/quickstart.py "$@"
