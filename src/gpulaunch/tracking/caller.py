"""The caller's side of a tracked launch: one MLflow run per call, opened and closed here.

The run is created by the caller, never by a rank: a rank that dies setting up a tracker takes
its peers down with it (gloo "Connection closed by peer"), and only the caller outlives every
outcome (success, a failing rank, timeout, cancel) to mark the run FINISHED / FAILED / KILLED.

Importing MLflow and building a fresh sqlite store take seconds, so that work runs in a thread
while the node agent starts (it imports torch meanwhile); the agent waits for ``tracking.json``
in the run directory before it starts the ranks, so every rank is born with ``MLFLOW_RUN_ID``.
Every MLflow call is guarded and time-bounded: a broken store costs a warning, never the run.
"""

from __future__ import annotations

import functools
import getpass
import importlib.metadata
import logging
import os
import platform
import sys
import threading
from pathlib import Path

from ..common import private, redact
from ..common.rundir import RunDir, hostname, write_json_atomic
from . import node, settings, store
from .guard import _bounded, _warned, warn_once  # noqa: F401 - _warned: tests reset it
from .run_end import TRACKING_JSON, RunEnd
from .settings import Tracking

_VERSIONS = ("torch", "gpulaunch", "mlflow", "transformers", "accelerate", "trl", "peft",
             "deepspeed", "lightning", "ray", "nvidia-ml-py")
# (store, experiment id, experiment name) -> (client, experiment id, name), once opened
_OPENED: dict[tuple, tuple] = {}
LAYOUT_PARAMS = ("world_size", "nproc_per_node", "nnodes")
# Logging ~25 parameters is tens of ms of SQLAlchemy in the caller: a call still running after
# this long logs them at once (they show while it runs); a shorter one leaves them to its end,
# off the call's path.
PARAMS_DELAY_S = 2.0


@functools.lru_cache(maxsize=1)
def _versions() -> dict[str, str]:
    # once per process: importlib.metadata scans sys.path (milliseconds a distribution)
    out = {"python": platform.python_version()}
    for dist in _VERSIONS:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


class CallTracker(RunEnd):
    """The MLflow run of one launch. ``begin()`` builds it; the launcher calls
    ``launch_fields()`` when it writes launch.json and ``end(state)`` when the run is over."""

    def __init__(self, cfg: Tracking, run: RunDir, *, label: str, spec, entry: dict,
                 layout_pending: bool = False):
        self.cfg = cfg
        # Ray: world size and node count are known only once placed (``placed()``); MLflow
        # params are write-once, so those wait instead of being logged with the pre-placement
        # guess.
        self._layout_pending = layout_pending
        self.run = run
        self.label = label
        self.spec = spec
        self.entry = entry
        self.target = settings.target(cfg)          # in the caller's thread, on purpose
        self.timeout = settings.setup_timeout()
        self.info: dict | None = None                # run_id, experiment, uri once created
        self._ready = threading.Event()
        node.LOCAL_READY[str(run.path)] = self._ready     # an in-process node hook waits on it
        self._ended = False
        self._over = threading.Event()          # the call is over: call_over()
        self._lock = threading.Lock()
        self._params_logged = False
        self._client = None
        # If setup hangs (an unreachable server retries for minutes), tell the agent to go on.
        # Made before the setup starts: a quick setup cancels it at once.
        self._watchdog = threading.Timer(self.timeout, self._give_up)
        self._watchdog.daemon = True
        self._thread = threading.Thread(target=self._setup, name="gpulaunch-mlflow-setup",
                                        daemon=True)
        self._thread.start()
        self._watchdog.start()

    # ------------------------------------------------------------------ identity
    @property
    def run_id(self) -> str | None:
        return (self.info or {}).get("run_id")

    def wait_ready(self, timeout: float | None = None) -> dict | None:
        """The run's ids once created (None if tracking was given up for this launch)."""
        self._ready.wait(self.timeout if timeout is None else timeout)
        return self.info

    def launch_fields(self, wait: bool = False) -> dict:
        """What launch.json carries. A node agent that shares this run directory waits for
        ``tracking.json``; a backend whose agents cannot see it passes ``wait=True``."""
        if wait:
            info = self.wait_ready()
            return dict(info or {"disabled": True})
        return {"pending": TRACKING_JSON, "wait_s": self.timeout + 5}

    # ------------------------------------------------------------------ setup (thread)
    def _setup(self) -> None:
        try:
            t = self.target
            key = (t.tracking_uri, t.experiment_id, t.experiment_name)
            opened = _OPENED.get(key)
            try:
                client, exp_id, exp_name = opened or self._open()
                run = client.create_run(exp_id, run_name=self.cfg.run_name or self.label,
                                        tags=self._tags())
            except Exception:  # noqa: BLE001 - the experiment deleted since? look it up again
                _OPENED.pop(key, None)
                if opened is None:
                    raise
                client, exp_id, exp_name = self._open()
                run = client.create_run(exp_id, run_name=self.cfg.run_name or self.label,
                                        tags=self._tags())
            _OPENED[key] = (client, exp_id, exp_name)
            run_id = run.info.run_id
            if self._ready.is_set():     # given up already: the ranks run untracked
                client.set_terminated(run_id, "KILLED")
                return
            self._client = client
            info = {"run_id": run_id, "experiment_id": exp_id, "experiment_name": exp_name,
                    "tracking_uri": t.tracking_uri, "parent_run_id": t.parent_run_id,
                    "system_metrics_interval": self.cfg.interval if self.cfg.system_metrics
                    else None, "ui": self.ui_hint(t.tracking_uri, exp_id, run_id)}
            self._publish(info)
            if not os.environ.get("GPULAUNCH_QUIET") and store.announce(t.tracking_uri):
                # once per store and process: one line per call is the run's own line
                sys.stdout.write(f"gpulaunch: MLflow run {run_id} (experiment {exp_name!r}); "
                                 f"{info['ui']}\n")
                sys.stdout.flush()
            if not self._over.wait(PARAMS_DELAY_S):      # a long call: its params now
                self._log_params_once(client, run_id)
        except BaseException as e:  # noqa: BLE001 - tracking must never fail the launch
            warn_once("could not create the run", f"{type(e).__name__}: {e}")
            self._publish(None)

    def _open(self):
        """The store's client and the run's experiment (created if new): a first sqlite store
        takes seconds to build, so later calls of this process reuse what this found."""
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.tracking import MlflowClient
        t = self.target
        # MLflow's "Creating initial MLflow database tables..." INFO lines: not the user's
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
        logging.getLogger("alembic").setLevel(logging.WARNING)
        with store.sqlite_create_lock(t.tracking_uri):
            client = MlflowClient(t.tracking_uri)
            exp_id, exp_name = self._experiment(client)
            if t.default_store:       # our sqlite file: owner-only, like the rest of home
                private.tighten(t.tracking_uri[len("sqlite:///"):])
        return client, exp_id, exp_name

    def _experiment(self, client) -> tuple[str, str]:
        """The experiment's id and name, created (with our artifact root) if it is new."""
        t = self.target
        if t.experiment_id is not None:
            return t.experiment_id, client.get_experiment(t.experiment_id).name
        name = t.experiment_name
        exp = client.get_experiment_by_name(name)
        if exp is not None and exp.lifecycle_stage != "deleted":
            return exp.experiment_id, name
        # Our own store keeps artifacts beside the database, not in the current directory.
        root = settings.default_artifact_root() if t.default_store else None
        loc = None if root is None else Path(root, name.replace("/", "_")).as_uri()
        try:
            return client.create_experiment(name, artifact_location=loc), name
        except Exception:  # noqa: BLE001 - another launch (another store) created it just now?
            exp = client.get_experiment_by_name(name)
            if exp is None or exp.lifecycle_stage == "deleted":
                raise
            return exp.experiment_id, name

    def _publish(self, info: dict | None) -> None:
        if self._ready.is_set():
            return
        self.info = info
        try:
            write_json_atomic(self.run.path / TRACKING_JSON, info or {"disabled": True})
        except OSError:
            pass
        self._ready.set()
        self._watchdog.cancel()

    def _give_up(self) -> None:
        if not self._ready.is_set():
            warn_once(f"the store did not answer within {self.timeout:g} s "
                      f"({self.target.tracking_uri})", "this run is not tracked")
            self._publish(None)

    def _tags(self) -> dict[str, str]:
        kind = self.entry.kind
        source = (self.label if kind == "function"
                  else " ".join(redact.mask_argv(self.entry.argv)))     # no --token values
        tags = {"gpulaunch.run_id": self.run.run_id, "gpulaunch.run_dir": str(self.run.path),
                "gpulaunch.entry": kind, "mlflow.source.name": source[:500],
                "mlflow.source.type": "LOCAL", "host": hostname()}
        try:
            tags["mlflow.user"] = getpass.getuser()
        except Exception:  # noqa: BLE001
            pass
        if self.target.parent_run_id:
            tags["mlflow.parentRunId"] = self.target.parent_run_id
        for k, v in (self.cfg.tags or {}).items():
            tags[str(k)] = str(v)
        return tags

    def call_over(self) -> None:
        """The call ended (its MLflow end is still to come)."""
        self._over.set()

    @property
    def over(self) -> bool:
        return self._over.is_set()

    def _log_params_once(self, client, run_id: str) -> None:
        with self._lock:
            if self._params_logged:
                return
            self._params_logged = True
        try:
            client.log_batch(run_id, params=self._params(
                skip=LAYOUT_PARAMS if self._layout_pending else ()))
        except Exception as e:  # noqa: BLE001 - params are a nicety; the run is there
            warn_once("logging launch parameters failed", f"{type(e).__name__}: {e}")

    def placed(self, spec) -> None:
        """The run's layout is known (Ray, after placement): log what waited for it."""
        self.spec = spec
        if not self._layout_pending:
            return
        self._layout_pending = False
        info = self.wait_ready()
        if not info or self._client is None:
            return
        params = [p for p in self._params() if p.key.split(".", 1)[-1] in LAYOUT_PARAMS]
        _bounded(lambda: self._client.log_batch(info["run_id"], params=params), self.timeout,
                 "logging the run's layout")

    def _params(self, skip=()):
        from mlflow.entities import Param
        s = self.spec
        gpu = getattr(s.gpu_type, "name", None) if s.gpu_type else None
        values = {"world_size": s.world_size, "nproc_per_node": s.nproc_per_node,
                  "nnodes": s.nnodes, "device": s.device, "backend": s.process_group_backend,
                  "gpu_type": gpu or ("cpu" if s.device == "cpu" else "unknown"),
                  "function": self.label, "entry": self.entry.kind,
                  "timeout": s.timeout, "max_restarts": s.max_restarts, "remote": s.remote,
                  "run_dir": str(self.run.path)}
        # Prefixed: MLflow params are write-once, and HF/Lightning log their own names.
        params = [Param(f"gpulaunch.{k}", str(v)[:6000]) for k, v in values.items()
                  if k not in skip]
        params += [Param(f"version.{k}", v) for k, v in _versions().items()]
        return params

    @staticmethod
    def ui_hint(uri: str, exp_id: str, run_id: str) -> str:
        if uri.startswith(("http://", "https://")):
            return f"view: {uri.rstrip('/')}/#/experiments/{exp_id}/runs/{run_id}"
        if uri == "databricks" or uri.startswith("databricks"):
            return "view: the Experiments page of your Databricks workspace"
        return f"view: mlflow ui --backend-store-uri {uri}"

