"""MLflow tracking of every launch (``pip install 'gpulaunch[mlflow]'``).

On by default when mlflow is importable; off with ``@distributed(..., tracking=False)``,
``gpulaunch run --no-tracking`` or ``GPULAUNCH_TRACKING=0``. Each ``.distributed()``,
``.submit()`` and ``gpulaunch run`` is one MLflow run:

* created by the caller (nested under the caller's active run if there is one) in the store the
  caller configured (``mlflow.set_tracking_uri``, ``MLFLOW_TRACKING_URI``), else in
  ``sqlite:///<GPULAUNCH_HOME or ~/.gpulaunch>/mlflow.db``; experiment "gpulaunch" unless the
  caller set one (``mlflow.set_experiment``, ``MLFLOW_EXPERIMENT_NAME``, ``tracking="name"``);
* parameters ``gpulaunch.*`` (world size, device, GPU type, function, run dir, ...) and
  ``version.*`` (torch, transformers, ...);
* ranks get ``MLFLOW_RUN_ID`` / ``MLFLOW_TRACKING_URI`` / ``MLFLOW_EXPERIMENT_ID``, so
  ``mlflow.log_metric`` and HF ``report_to="mlflow"`` write into it; Lightning:
  ``logger=gpulaunch.tracking.mlflow_logger()``;
* each node agent logs ``system/node_<k>/...`` (CPU, host memory, ranks' RSS, and per GPU
  utilisation, memory, power, temperature through NVML) every 5 s;
* at the end: per-rank logs and the status / error report as artifacts, ``metrics.png`` in the
  run directory, status FINISHED / FAILED / KILLED. The run id is ``RunHandle.mlflow_run_id``
  and ``tracking.json`` in the run directory. This end work runs in a background thread, after
  the call has returned; ``gpulaunch.tracking.flush()`` waits for it (the interpreter's exit
  does too).

A broken or unreachable store costs one warning and the run's tracking, never the run.
"""

from .callback import flush
from .inrank import experiment_id, mlflow_logger, run_id, tracking_uri
from .plots import plot_metrics
from .settings import Tracking

__all__ = ["Tracking", "run_id", "tracking_uri", "experiment_id", "mlflow_logger",
           "plot_metrics", "flush"]
