"""Helpers for code inside a rank: the MLflow run gpulaunch opened for this launch.

    import mlflow
    mlflow.log_metric("loss", loss, step=step)          # lands in gpulaunch's run as is

    trainer = Trainer(..., report_to="mlflow")           # HF: honours MLFLOW_RUN_ID as is

    from gpulaunch.tracking import mlflow_logger          # Lightning ignores MLFLOW_RUN_ID:
    pl.Trainer(logger=mlflow_logger())                    # MLFlowLogger(run_id=<gpulaunch's>)

Outside a tracked launch every helper returns None (``mlflow_logger()`` then builds a plain
``MLFlowLogger``), so the same function still runs with ``train.func(...)``.
"""

from __future__ import annotations

import os

from ..common import private
from .node import RUN_ID_ENV


def run_id() -> str | None:
    """The MLflow run id of this launch (also after MLflow consumed ``MLFLOW_RUN_ID``)."""
    return os.environ.get(RUN_ID_ENV) or None


def tracking_uri() -> str | None:
    return os.environ.get("MLFLOW_TRACKING_URI") or None


def experiment_id() -> str | None:
    return os.environ.get("MLFLOW_EXPERIMENT_ID") or None


def mlflow_logger(**kwargs):
    """Lightning's ``MLFlowLogger`` writing into this launch's run (``run_id=`` and
    ``tracking_uri=`` filled in; other keyword arguments pass through)."""
    try:
        from lightning.pytorch.loggers import MLFlowLogger
    except ImportError:
        from pytorch_lightning.loggers import MLFlowLogger
    rid = run_id()
    if rid is not None:
        kwargs.setdefault("run_id", rid)
        kwargs.setdefault("tracking_uri", tracking_uri())
        if os.environ.get("MLFLOW_EXPERIMENT_NAME"):
            kwargs.setdefault("experiment_name", os.environ["MLFLOW_EXPERIMENT_NAME"])
    return MLFlowLogger(**kwargs)


PARAMS_FILE = "params.rank0.json"


def record_param(key: str, value) -> None:
    """Note a fact about this launch (e.g. the strategy prepare() chose) as a ``gpulaunch.*``
    parameter of its MLflow run. Rank 0 writes it into the run directory; the caller logs it
    at the end, so no rank imports MLflow for it. First value per key wins (MLflow parameters
    are write-once). A no-op outside a tracked launch."""
    run_dir = os.environ.get("GPULAUNCH_RUN_DIR")
    if not run_dir or not run_id() or os.environ.get("RANK", "0") != "0":
        return
    import json
    path = os.path.join(run_dir, PARAMS_FILE)
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        data = {}
    if key in data:
        return
    data[key] = str(value)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with private.open_file(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        pass
