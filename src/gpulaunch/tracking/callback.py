"""MLflow tracking as a run callback (``caller.callbacks``): one MLflow run per launch.

The pipeline asks ``tracking_callback(options.tracking)`` for it; the node agents get the run's
ids through the launch record's ``extensions["tracking"]`` (hook: ``tracking.node``).
"""

from __future__ import annotations

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
        if self.tracker is not None:
            self.tracker.end(str(state), run)

    def run_id(self) -> str | None:
        if self.tracker is None:
            return None
        info = self.tracker.wait_ready()
        return info["run_id"] if info else None

    def wait_ready(self):
        return self.tracker.wait_ready() if self.tracker is not None else None


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
