#!/usr/bin/env bash
# Set up the environment if needed, then run the whole test suite (CPU workers, gloo).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$("$repo/scripts/venv.sh")"
cd "$repo"
export PYTHONUNBUFFERED=1
exec "$venv/bin/python" -m pytest -ra "$@"
