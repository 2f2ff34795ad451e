"""``RayProgramRun``: the run behind ``ray_launch`` (``Run`` protocol): one driver task on node
0 of a reserved allocation, every Ray task it starts placed inside it. The decorator is in
``ray_launch.py``; the pipeline starts this as backend "ray_program".
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import cloudpickle

from ...caller.controller import RunController
from ...caller.outcome import RankFailure, RunOutcome
from ...common.records import LaunchRecord, RankError, RunState, StopReason
from ...common.rundir import RunDir
from . import placement
from .cluster import RayCluster, connect

PG_ENV = "GPULAUNCH_RAY_PLACEMENT_GROUP"


def _run_in_allocation(payload: bytes, env: dict):
    """Body of the driver task, on node 0 of the allocation."""
    from ...common.payload import load_call
    os.environ.update(env)
    with tempfile.NamedTemporaryFile(prefix="gpulaunch-payload-", suffix=".pkl") as f:
        f.write(payload)
        f.flush()
        func, args, kwargs = load_call(f.name)
    return func(*args, **kwargs)


class RayProgramRun(RunController):
    """A ``ray_launch`` call: one task on node 0 of a reserved allocation (its lifecycle:
    ``RunController``)."""

    poll_interval = 0.5

    def __init__(self, record: LaunchRecord, run: RunDir, payload: bytes, *, cluster=None,
                 callbacks=None):
        super().__init__(record, run, callbacks=callbacks)
        self.payload = payload
        self.cluster = RayCluster.coerce(cluster)
        self.layout = None
        self._ray = self._pg = self._ref = None
        self._result = None            # ("ok", value) | ("err", exception) once done

    def describe(self) -> str:
        return f"{self.layout.describe()} on the Ray cluster (ray_launch: one driver task)"

    def _start(self) -> None:
        ray = self._ray = connect(self.cluster)
        layout = self.layout = placement.plan(
            placement.cluster_nodes(ray), gpus=self.spec.nproc_per_node,
            gpu_type=self.spec.gpu_type, gpus_per_node=self.cluster.gpus_per_node,
            autoscaling=self.cluster.autoscaling)
        self.spec = dataclasses.replace(self.spec, nproc_per_node=layout.nproc_per_node,
                                        nnodes=layout.nnodes, device=layout.device)
        self.run.write_launch(dataclasses.replace(self.record, spec=self.spec,
                                                  backend="ray_program", started=time.time()))
        # A name of this run's own: two concurrent submits never share a placement group.
        name = f"gpulaunch-ray-launch-{self.run.run_id}"
        try:
            self._pg, _ = placement.reserve(ray, layout, timeout=self.cluster.placement_timeout,
                                            name=name)
        except BaseException:
            # reserve() removes its group on an Exception; a KeyboardInterrupt (Ctrl-C while
            # waiting for a busy cluster) would leave it holding the cluster: find it by name
            _remove_named_group(name)
            raise
        try:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=0,
                placement_group_capture_child_tasks=True)
            env = dict(self.spec.env, **{PG_ENV: self._pg.id.hex(), "GPULAUNCH_RAY_LAYOUT":
                                         f"{layout.nnodes}x{layout.nproc_per_node}:"
                                         f"{layout.device}"})
            task = ray.remote(_run_in_allocation).options(num_cpus=0, num_gpus=0, max_retries=0,
                                                          scheduling_strategy=strategy)
            self._ref = task.remote(self.payload, env)
        except BaseException:
            self._release()                # never leak the reservation
            raise

    def _poll(self) -> None:
        ready, _ = self._ray.wait([self._ref], timeout=0)
        if ready:
            try:
                self._end(("ok", self._ray.get(self._ref)))
            except BaseException as e:  # noqa: BLE001 - the task's failure, as data
                self._end(("err", e))

    def pause(self, seconds: float) -> None:
        if not self.finished:
            self._ray.wait([self._ref], timeout=seconds)

    def _stop(self, reason: StopReason) -> None:
        self._end(None)

    def _end(self, result) -> None:
        self._result = result
        if result is None or result[0] == "err":
            try:
                self._ray.cancel(self._ref, force=True, recursive=True)
            except Exception:  # noqa: BLE001
                pass
        self._release()
        self.ended()

    def _release(self) -> None:
        if self._pg is not None:
            try:
                from ray.util.placement_group import remove_placement_group
                remove_placement_group(self._pg)   # also ends what was left inside it
            except Exception:  # noqa: BLE001
                pass
            self._pg = None

    def _final_state(self) -> RunState:
        return RunState.SUCCEEDED if self._result and self._result[0] == "ok" \
            else RunState.FAILED

    def outcome(self) -> RunOutcome:
        base = dict(run_dir=str(self.run.path), world_size=self.spec.world_size,
                    reason=self.reason, timeout=self.spec.timeout, entry_kind="ray_program")
        if self._result is None:
            return RunOutcome(state=RunState.STOPPED, **base)
        kind, value = self._result
        if kind == "ok":
            rest = [None] * (self.spec.world_size - 1)
            return RunOutcome(state=RunState.SUCCEEDED, load_results=lambda: [value] + rest,
                              **base)
        cause = getattr(value, "cause", None)
        if isinstance(cause, BaseException) and type(value).__name__.startswith("RayTaskError"):
            err = RankError(type=f"{type(cause).__module__}.{type(cause).__qualname__}",
                            message=str(cause), traceback=str(value), rank=0, host="node 0",
                            exception=_pickled(cause), time=time.time())
            return RunOutcome(state=RunState.FAILED, failures=(RankFailure(0, 1, err, "node 0"),),
                              **base)
        return RunOutcome(state=RunState.AGENT_ERROR,
                          agent_error=f"ray_launch {self.label}: {type(value).__name__}: {value}",
                          **base)


def _remove_named_group(name: str) -> None:
    try:
        from ray.util import get_placement_group
        from ray.util.placement_group import remove_placement_group
        remove_placement_group(get_placement_group(name))
    except Exception:  # noqa: BLE001 - none of that name (reserve() removed it already)
        pass


def _pickled(exc: BaseException) -> bytes | None:
    try:
        blob = cloudpickle.dumps(exc)
        cloudpickle.loads(blob)
        return blob
    except Exception:  # noqa: BLE001 - the caller raises RemoteError with the text
        return None
