"""The end of a call's MLflow run (``CallTracker.end``, in the background after the call):
the launch parameters if not logged yet, what rank 0 recorded, the system samples handed to
the caller, the logs and the status/error report as artifacts, ``metrics.png``, the final
status; then the default store's new artifact folders owner-only and tracking.json updated."""

from __future__ import annotations

import time
from pathlib import Path

from ..common import private
from ..common.records import RunState
from ..common.rundir import read_json, write_json_atomic
from . import store
from .guard import _bounded

TRACKING_JSON = "tracking.json"
# gpulaunch state -> MLflow run status
_STATUS = {RunState.SUCCEEDED: "FINISHED", RunState.FAILED: "FAILED",
           RunState.TIMED_OUT: "FAILED", RunState.CANCELLED: "KILLED"}


class RunEnd:
    """``CallTracker``'s end (a mixin: it uses the tracker's run, cfg, target, client)."""

    def end(self, state: str, run=None, pause=None) -> None:
        """Upload logs and the status/error report, plot the curves, set the final status.
        Bounded in time; never raises. ``pause()`` is called between the steps (the caller
        holds them back while another call runs)."""
        if self._ended:
            return
        self._ended = True
        self._pause = pause or (lambda: None)
        info = self.wait_ready(self.timeout)
        if not info:
            return
        self._pause()
        _bounded(lambda: self._collect(info["run_id"], state, info["tracking_uri"], run),
                 self.timeout, "uploading logs and plots")
        status = _STATUS.get(RunState(state), "FAILED")
        # The status on its own, after the uploads: slow artifacts never leave it RUNNING.
        self._pause()
        _bounded(lambda: self._client.set_terminated(info["run_id"], status), self.timeout,
                 "setting the run's final status")
        if self.target.default_store:     # MLflow made the artifact folders with the umask
            store.tighten_artifacts(info)
        _merge_json(self.run.path / TRACKING_JSON, {"status": status,
                                                    "state": RunState(state).value,
                                                    "ended": time.time()})

    def _collect(self, run_id: str, state: str, uri: str, run=None) -> None:
        client = self._client
        self._log_params_once(client, run_id)
        client.set_tag(run_id, "gpulaunch.state", state)
        self._log_recorded_params(client, run_id)
        self._log_handed_off_system_metrics(client, run_id)
        if self.cfg.log_artifacts:
            self._pause()
            self._upload(client, run_id, state, run)
        if self.cfg.plot:
            self._pause()
            from .plots import plot_metrics
            try:
                png = plot_metrics(run_id, self.run.path / "metrics.png", tracking_uri=uri,
                                   client=client)
                if png is not None:
                    client.log_artifact(run_id, str(png))
            except ImportError:
                pass            # matplotlib not installed: the UI still shows the curves

    def _log_recorded_params(self, client, run_id: str) -> None:
        """What rank 0 noted with ``tracking.inrank.record_param`` (e.g. prepare()'s strategy)."""
        from mlflow.entities import Param

        from .inrank import PARAMS_FILE
        recorded = read_json(self.run.path / PARAMS_FILE, {}) or {}
        if recorded:
            client.log_batch(run_id, params=[Param(f"gpulaunch.{k}", str(v)[:6000])
                                             for k, v in recorded.items()])

    def _log_handed_off_system_metrics(self, client, run_id: str) -> None:
        """Samples a node agent took but left to us (its MLflow client was not ready yet: a
        short run; or the store failed it). See ``tracking.system.SystemMetricsLogger``."""
        from .system import log_samples
        for path in sorted(self.run.path.glob("system_metrics.node*.json")):
            data = read_json(path, {}) or {}
            if data.get("run_id") != run_id:
                continue
            log_samples(client, run_id, [(s["timestamp"], s["step"], s["values"])
                                         for s in data.get("samples", [])])

    def _upload(self, client, run_id: str, state: str, backend_run=None) -> None:
        run = self.run
        if RunState(state) is not RunState.SUCCEEDED and backend_run is not None:
            report = _error_report(backend_run)
            if report:
                with private.open_file(run.path / "error.txt") as f:
                    f.write(report)
        for name in ("status.json", "launch.json", "agent.log", "hang.json", "error.txt",
                     TRACKING_JSON):
            path = run.path / name
            if path.exists():
                client.log_artifact(run_id, str(path), "gpulaunch")
        for extra in sorted(run.path.glob("status.node*.json")):
            client.log_artifact(run_id, str(extra), "gpulaunch")
        for attempt in run.attempts():
            adir = run.attempt_dir(attempt)
            for path in sorted(adir.iterdir()):
                if not path.is_file() or path.name.endswith((".pkl", ".tmp")):
                    continue
                if path.suffix in (".log", ".stacks", ".json") and path.stat().st_size > 0:
                    client.log_artifact(run_id, str(path), f"logs/attempt{attempt}")


def _error_report(backend_run) -> str:
    """The same error text the caller is about to raise, for the run's artifacts."""
    from ..caller.outcome import settle
    try:
        settle(backend_run.outcome())
    except BaseException as e:  # noqa: BLE001 - this is the point
        import traceback
        # Without the caller's frames: the rank's traceback is chained in as the cause.
        return "".join(traceback.format_exception(type(e), e, None))
    return ""


def _merge_json(path: Path, extra: dict) -> None:
    data = read_json(path, {}) or {}
    data.update(extra)
    try:
        write_json_atomic(path, data)
    except OSError:
        pass
