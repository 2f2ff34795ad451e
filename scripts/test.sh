#!/usr/bin/env bash
# Set up the environment if needed, then run the test suite (CPU workers, gloo). Arguments go to
# pytest; with none, everything runs (what CI does). One tier at a time:
#   scripts/test.sh -m unit                  pure logic, no process started: under 30 s
#   scripts/test.sh -m integration           real processes, Ray, MLflow, Jupyter: minutes
#   scripts/test.sh -m slow                  the long end-to-end runs (recipes, restarts)
#   scripts/test.sh -m "not slow"            unit + integration
#   scripts/test.sh tests/pool               one subject (tests/<subject>/)
# The GPU suite (tests/gpu, marker gpu) skips itself without a CUDA GPU: scripts/gpu_suite.sh.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$("$repo/scripts/venv.sh")"
cd "$repo"
export PYTHONUNBUFFERED=1
exec "$venv/bin/python" -m pytest -ra "$@"
