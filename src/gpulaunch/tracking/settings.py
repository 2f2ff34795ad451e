"""What the user asked for: ``tracking=`` on the decorator, ``GPULAUNCH_TRACKING``, and which
MLflow store, experiment and parent run a launch writes into. Pure decisions; no MLflow import
unless the caller already imported it (reading its active run and experiment is then free).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys

from ..common import rundir
from ..errors import ConfigurationError

ENV_SWITCH = "GPULAUNCH_TRACKING"             # 0/false/off: never track; 1/true/on: must track
ENV_INTERVAL = "GPULAUNCH_SYSTEM_METRICS_INTERVAL"
ENV_SETUP_TIMEOUT = "GPULAUNCH_TRACKING_TIMEOUT"
DEFAULT_EXPERIMENT = "gpulaunch"
DEFAULT_INTERVAL_S = 5.0
DEFAULT_SETUP_TIMEOUT_S = 60.0     # a first sqlite store build takes seconds on a loaded host
_OFF = ("0", "false", "off", "no")
_ON = ("1", "true", "on", "yes")


@dataclasses.dataclass(frozen=True)
class Tracking:
    """How a launch is tracked in MLflow. ``@distributed(tracking=Tracking(...))``.

    experiment: experiment name (default: the caller's active experiment or run, else
        ``MLFLOW_EXPERIMENT_NAME``/``_ID``, else "gpulaunch").
    run_name: MLflow run name (default: the function or script name).
    tracking_uri: store (default: the caller's ``mlflow.set_tracking_uri``/``MLFLOW_TRACKING_URI``,
        else ``sqlite:///<GPULAUNCH_HOME>/mlflow.db``).
    tags: extra run tags.
    system_metrics: sample CPU, host memory and per-GPU utilisation/memory/power on each node.
    system_metrics_interval: seconds between samples (``GPULAUNCH_SYSTEM_METRICS_INTERVAL``).
    log_artifacts: upload per-rank logs and the run's status/error report at the end.
    plot: save the logged metric curves as ``metrics.png`` in the run directory (and upload it).
    """

    enabled: bool | None = None       # None: on when mlflow is importable
    experiment: str | None = None
    run_name: str | None = None
    tracking_uri: str | None = None
    tags: dict | None = None
    system_metrics: bool = True
    system_metrics_interval: float | None = None
    log_artifacts: bool = True
    plot: bool = True

    def __post_init__(self):
        interval = self.system_metrics_interval
        if interval is not None and not (isinstance(interval, (int, float)) and interval > 0):
            raise ConfigurationError(f"system_metrics_interval must be a positive number of "
                                     f"seconds; got {interval!r}.")

    @property
    def interval(self) -> float:
        if self.system_metrics_interval is not None:
            return float(self.system_metrics_interval)
        raw = os.environ.get(ENV_INTERVAL)
        try:
            return float(raw) if raw else DEFAULT_INTERVAL_S
        except ValueError:
            return DEFAULT_INTERVAL_S


def normalize(value) -> Tracking:
    """``tracking=`` as written: None/True/False, an experiment name, a dict, or ``Tracking``."""
    if value is None:
        return Tracking()
    if isinstance(value, Tracking):
        return value
    if isinstance(value, bool):
        return Tracking(enabled=value)
    if isinstance(value, str):
        return Tracking(enabled=True, experiment=value)
    if isinstance(value, dict):
        try:
            return Tracking(**{"enabled": True, **value})
        except TypeError as e:
            raise ConfigurationError(f"tracking={value!r}: {e}. Known keys: "
                                     f"{[f.name for f in dataclasses.fields(Tracking)]}.") from None
    raise ConfigurationError(f"tracking= takes True/False, an experiment name, a dict or "
                             f"gpulaunch.tracking.Tracking(...); got {value!r}.")


def mlflow_installed() -> bool:
    return "mlflow" in sys.modules or importlib.util.find_spec("mlflow") is not None


def enabled(t: Tracking) -> bool:
    """Whether this launch is tracked. An explicit request without mlflow is a user error."""
    env = os.environ.get(ENV_SWITCH, "").strip().lower()
    if env in _OFF or t.enabled is False:
        return False
    wanted = t.enabled is True or env in _ON
    if not mlflow_installed():
        if wanted:
            raise ConfigurationError("tracking was requested but mlflow is not installed: "
                                     "pip install 'gpulaunch[mlflow]' (or pass tracking=False).")
        return False
    return True


def default_store_uri() -> str:
    return f"sqlite:///{(rundir.home() / 'mlflow.db').resolve()}"


def default_artifact_root() -> str:
    return str((rundir.home() / "mlartifacts").resolve())


def setup_timeout() -> float:
    try:
        return float(os.environ.get(ENV_SETUP_TIMEOUT) or DEFAULT_SETUP_TIMEOUT_S)
    except ValueError:
        return DEFAULT_SETUP_TIMEOUT_S


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the run goes, decided in the caller's thread (MLflow's active run is per thread)."""
    tracking_uri: str
    default_store: bool              # our own sqlite store: we choose the artifact root
    experiment_name: str | None
    experiment_id: str | None
    parent_run_id: str | None


def target(t: Tracking) -> Target:
    mlflow = sys.modules.get("mlflow")      # imported by the caller: it may hold state for us
    uri = t.tracking_uri
    parent = None
    exp_id = None
    if mlflow is not None:
        try:
            if uri is None and mlflow.is_tracking_uri_set():
                uri = mlflow.get_tracking_uri()
            active = mlflow.active_run()
            if active is not None:
                parent = active.info.run_id
                exp_id = active.info.experiment_id
            fluent = sys.modules.get("mlflow.tracking.fluent")
            exp_id = getattr(fluent, "_active_experiment_id", None) or exp_id
        except Exception:      # noqa: BLE001 - a caller's broken MLflow state is not ours to fix
            pass
    if parent is None:
        parent = os.environ.get("MLFLOW_RUN_ID") or None    # e.g. inside `mlflow run`
    if uri is None:
        uri = os.environ.get("MLFLOW_TRACKING_URI") or None
    default = uri is None
    if default:
        uri = default_store_uri()
    name = t.experiment
    if name is not None:
        exp_id = None
    elif exp_id is None:
        exp_id = os.environ.get("MLFLOW_EXPERIMENT_ID") or None
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or (None if exp_id else DEFAULT_EXPERIMENT)
    return Target(uri, default, name, exp_id, parent)
