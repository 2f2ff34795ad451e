#!/usr/bin/env bash
# Set up the environment if needed, then run the quickstart on every GPU here (or 2 CPU workers).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$("$repo/scripts/venv.sh")"
cd "$repo"
exec "$venv/bin/python" recipes/quickstart.py "$@"
