"""The node agent's side of tracking: give the ranks the run's MLflow ids, sample the node.

The node agent calls ``node_hook`` (a launch-record extension, ``backends.local.node_hooks``)
before the ranks start. With the ids in the
environment, ``mlflow.log_metric`` in a rank, HF ``report_to="mlflow"`` (it honours
``MLFLOW_RUN_ID``) and Lightning's ``MLFlowLogger(run_id=gpulaunch.tracking.run_id())`` all
write into the run the caller created. Nothing here imports MLflow in the agent's main thread.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref

from ..common.rundir import RunDir, read_json

RUN_ID_ENV = "GPULAUNCH_MLFLOW_RUN_ID"   # MLflow deletes MLFLOW_RUN_ID once it resumes the run
POLL_S = 0.01          # an agent in another process watches for tracking.json this often
# run directory -> the caller's "run created" event. A warm pool runs its node hook in the
# caller's own process: it waits on the event (woken the moment the run exists) instead of
# polling the file.
LOCAL_READY: "weakref.WeakValueDictionary[str, threading.Event]" = weakref.WeakValueDictionary()


def _log(msg: str) -> None:
    sys.stderr.write(f"gpulaunch-agent: tracking: {msg}\n")
    sys.stderr.flush()


def resolve_info(info: dict, run: RunDir) -> dict | None:
    """The run's ids from the launch record's fields, or from tracking.json once the caller
    wrote it."""
    if not info or info.get("disabled"):
        return None
    pending = info.get("pending")
    if pending:
        wait_s = float(info.get("wait_s", 65))
        deadline = time.monotonic() + wait_s
        path = run.path / pending
        ready = LOCAL_READY.get(str(run.path))
        if ready is not None:
            ready.wait(wait_s)
        info = None
        while time.monotonic() < deadline:
            info = read_json(path)
            if info is not None:
                break
            time.sleep(POLL_S)
        if info is None:
            _log(f"no {pending} from the caller in time; ranks run untracked")
            return None
    return info if info.get("run_id") else None


def worker_env(info: dict) -> dict[str, str]:
    env = {"MLFLOW_TRACKING_URI": info["tracking_uri"], "MLFLOW_RUN_ID": info["run_id"],
           RUN_ID_ENV: info["run_id"], "MLFLOW_EXPERIMENT_ID": str(info["experiment_id"])}
    if info.get("experiment_name"):
        # HF's callback calls set_experiment(MLFLOW_EXPERIMENT_NAME): it must name the run's.
        env["MLFLOW_EXPERIMENT_NAME"] = info["experiment_name"]
    return env


class NodeTracking:
    """What ``node_hook()`` prepared on this node (the agent calls ``env()``, then
    ``on_ranks_started()``, ``stop()`` at its exit)."""

    def __init__(self, info: dict, logger=None):
        self.info = info
        self.logger = logger

    def env(self) -> dict[str, str]:
        return dict(worker_env(self.info), MLFLOW_DISABLE_TELEMETRY=os.environ.get(
            "MLFLOW_DISABLE_TELEMETRY", "true"))

    def status_fields(self) -> dict[str, str]:
        return {"mlflow_run_id": self.info["run_id"]}

    def on_ranks_started(self) -> None:
        """Start the system-metrics thread. The agent calls this once its ranks are running:
        ranks are forked from the agent, and a fork taken while this thread imports MLflow (or
        holds stderr's lock) would hand the child locks that nobody will ever release."""
        if self.logger is not None and not self.logger.started:
            self.logger.start()

    def stop(self) -> None:
        if self.logger is not None and self.logger.started:
            self.logger.stop()


def handoff_name(node_rank: int) -> str:
    return f"system_metrics.node{node_rank}.json"


def node_hook(record, run: RunDir, fields: dict, node_rank: int) -> NodeTracking | None:
    """Prepare this node's share of the run's tracking (the ids for the ranks, the
    system-metrics thread started once the ranks are forked). Never raises: a problem here
    costs the run its tracking, not its training."""
    try:
        info = resolve_info(fields, run)
        if info is None:
            return None
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        logger = None
        interval = info.get("system_metrics_interval")
        if interval:
            from .system import SystemMetricsLogger
            # Samples the agent could not log before it exits (its MLflow client not ready:
            # importing MLflow takes seconds) go to the caller in this run directory: shared
            # with the caller on one host, mirrored to it by a Ray node agent's polls. The
            # agent never waits for its client (it held every Ray failure for up to 10 s).
            handoff = run.path / handoff_name(node_rank)
            logger = SystemMetricsLogger(info["run_id"], info["tracking_uri"], node_rank,
                                         float(interval), nproc=record.spec.nproc_per_node,
                                         log=_log, handoff=handoff)
        return NodeTracking(info, logger)
    except Exception as e:  # noqa: BLE001
        _log(f"disabled on this node: {type(e).__name__}: {e}")
        return None
