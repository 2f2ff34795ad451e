"""MLflow tracking as a run callback (``caller.callbacks``): one MLflow run per launch.

The pipeline asks ``tracking_callback(options.tracking)`` for it; the node agents get the run's
ids through the launch record's ``extensions["tracking"]`` (hook: ``tracking.node``).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
import weakref

from ..caller.callbacks import LaunchContext, RunCallback
from ..common.rundir import hostname
from . import settings
from .caller import CallTracker, warn_once

NODE_HOOK = "gpulaunch.tracking.node"


class TrackingCallback(RunCallback):
    name = "tracking"

    def __init__(self, cfg: settings.Tracking):
        self.cfg = cfg
        self.tracker: CallTracker | None = None

    def on_launch(self, ctx: LaunchContext) -> dict | None:
        try:
            self.tracker = CallTracker(self.cfg, ctx.run, label=ctx.label, spec=ctx.spec,
                                       entry=ctx.entry, layout_pending=ctx.remote)
        except Exception as e:  # noqa: BLE001 - tracking never fails the launch
            warn_once("could not start", f"{type(e).__name__}: {e}")
            return None
        _CALLS.add(self.tracker)
        if ctx.remote:
            return None            # the nodes cannot read our run directory: node_fields()
        return dict(self.tracker.launch_fields(), hook=NODE_HOOK)

    def node_fields(self, hosts: list[str]) -> dict | None:
        """The run's ids for node agents on ``hosts``. A store that is a file on the caller's
        machine (the default sqlite database) is reachable from other machines only through
        shared storage: say so, once, up front."""
        if self.tracker is None:
            return None
        info = self.tracker.wait_ready()
        if not info or not info.get("run_id"):
            return None
        here = hostname()
        elsewhere = [h for h in hosts if h != here]
        if elsewhere and is_local_store(info["tracking_uri"]):
            warn_once(f"the store {info['tracking_uri']} is a file on {here}",
                      f"ranks on {', '.join(elsewhere)} can write to it only if that path is "
                      "shared storage mounted at the same place; for multi-node runs point "
                      "MLFLOW_TRACKING_URI at a tracking server (mlflow server ...)")
        return dict(info, hook=NODE_HOOK)

    def on_placed(self, spec) -> None:
        if self.tracker is not None:
            self.tracker.placed(spec)

    def on_start(self, run) -> None:
        if self.tracker is not None:
            self.tracker.spec = run.spec

    def on_end(self, run, state) -> None:
        """Off the call's path: the uploads, the plot and the final status go to one
        background thread (in order, call after call), which waits while another call runs
        (``_IdleGate``); ``flush()`` and the interpreter's exit wait for them."""
        if self.tracker is not None:
            self.tracker.call_over()
            with _LOCK:
                _PENDING[:] = [f for f in _PENDING if not f.done()]
                _PENDING.append(_ender().submit(self.tracker.end, str(state), run,
                                                _IdleGate().wait))

    def run_id(self) -> str | None:
        if self.tracker is None:
            return None
        info = self.tracker.wait_ready()
        return info["run_id"] if info else None

    def wait_ready(self):
        return self.tracker.wait_ready() if self.tracker is not None else None


_LOCK = threading.Lock()
_PENDING: list[concurrent.futures.Future] = []
_EXECUTOR: concurrent.futures.ThreadPoolExecutor | None = None


# A run's end is 0.1-0.3 s of SQLite transactions, file copies and a matplotlib plot. Beside a
# call of this process it takes the GIL from the caller's loop that hands work to the ranks and
# reads their answers (a busy Python thread made a 0.01 s warm call take 0.2 s; 0.05 s when
# niced). So an end waits while calls of this process run, at most END_DEFER_MAX_S (calls back
# to back must not keep their runs RUNNING for ever), and its thread runs at a lower priority.
END_DEFER_MAX_S = 10.0
END_QUIET_S = 0.3
END_NICE = 10


# Tracked calls from on_launch on (ACTIVE has a run only once it started); weak, so that a
# launch that failed before its end was told cannot hold the ends back.
_CALLS: "weakref.WeakSet[CallTracker]" = weakref.WeakSet()


def _busy() -> bool:
    from ..caller.registry import ACTIVE
    return any(not t.over for t in list(_CALLS)) or bool(ACTIVE.runs())


class _IdleGate:
    """``wait()`` returns once no call of this process has run for END_QUIET_S (calls in a
    loop follow each other within milliseconds, and a call registers as running only after
    its start), or END_DEFER_MAX_S after the gate's first wait (an end made to wait longer
    runs beside the calls)."""

    def __init__(self):
        self.deadline: float | None = None
        self.last_busy = time.monotonic()       # the call that just ended

    def wait(self) -> None:
        if self.deadline is None:
            self.deadline = time.monotonic() + END_DEFER_MAX_S
        while threading.main_thread().is_alive():   # at the interpreter's exit: no more calls
            now = time.monotonic()
            if _busy():
                self.last_busy = now
            if now - self.last_busy >= END_QUIET_S or now >= self.deadline:
                return
            time.sleep(0.02)


def _lower_priority() -> None:
    try:                       # Linux: a thread id is a valid PRIO_PROCESS target
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), END_NICE)
    except (AttributeError, OSError):
        pass


def _ender() -> concurrent.futures.ThreadPoolExecutor:
    # one worker: a run's end never overtakes the previous one's; its thread is joined at
    # interpreter exit (concurrent.futures does that), so a script's last run is finished too
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = concurrent.futures.ThreadPoolExecutor(1, "gpulaunch-mlflow-end",
                                                          initializer=_lower_priority)
    return _EXECUTOR


def flush(timeout: float | None = None) -> bool:
    """Wait until every finished call's MLflow run is complete (logs uploaded, final status
    set); True if none is left pending."""
    with _LOCK:
        pending = list(_PENDING)
    done, not_done = concurrent.futures.wait(pending, timeout=timeout)
    return not not_done


def is_local_store(uri: str) -> bool:
    """A store that lives in this machine's file system (not a server)."""
    if "://" in uri:
        return uri.split("://", 1)[0] in ("sqlite", "file")
    return not uri.startswith("databricks")      # a bare path is a file store


def tracking_callback(value) -> TrackingCallback | None:
    """The callback for ``tracking=`` (None when tracking is off). Raises only for a user error
    (``tracking=True`` without mlflow)."""
    cfg = settings.normalize(value)
    if not settings.enabled(cfg):
        return None
    return TrackingCallback(cfg)
