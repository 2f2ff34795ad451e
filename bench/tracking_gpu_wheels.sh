#!/usr/bin/env bash
# Wheels that let MLflow tracking (sqlite store) run on the lent GPU machine, which has no
# network and no mlflow (its python3 is 3.12). mlflow-skinny + SQLAlchemy + alembic is enough
# for a sqlite store (checked in a clean venv: create/resume a run, metrics, artifacts); the
# full `mlflow` adds the UI server, pandas/scikit-learn flavours and is not needed to log.
# The rest is mlflow-skinny's dependency closure minus what the GPU image already holds
# (KINDS.md list: requests, protobuf, pyyaml, click, cloudpickle, anyio, psutil, matplotlib,
# nvidia-ml-py, ... are there).
# Usage, from the repo root:  bash bench/tracking_gpu_wheels.sh   -> ./.whl/mlflow/ (ignored by git)
# On the GPU machine (carry .whl):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/mlf .whl/mlflow/*.whl
#   PYTHONPATH=/tmp/mlf python3 bench/tracking_gpu.py
set -euo pipefail
DEST=${1:-.whl/mlflow}
mkdir -p "$DEST"
PY=${PYTHON:-python3}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_34_x86_64 --platform linux_x86_64 -d "$DEST" \
  mlflow-skinny==3.17.2 SQLAlchemy==2.1.9 alembic==1.20.1 Mako==1.4.3 \
  annotated-types==0.8.0 cachetools==7.3.3 cffi==2.1.1 cryptography==50.0.2 \
  databricks-sdk==0.167.0 fastapi==0.165.0 gitdb==4.0.12 GitPython==3.2.1 google-auth==2.63.0 \
  importlib_metadata==9.1.0 opentelemetry-api==1.45.2 opentelemetry-proto==1.45.2 \
  opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 pyasn1==0.6.5 \
  pyasn1_modules==0.4.2 pycparser==3.12 pydantic==2.14.4 pydantic_core==2.50.5 \
  python-dotenv==1.2.4 smmap==5.0.3 sqlparse==0.6.1 starlette==1.10.0 typing-inspection==0.4.5 \
  uvicorn==0.55.0
echo "$(ls "$DEST" | wc -l) wheels in $DEST ($(du -sh "$DEST" | cut -f1))"
