"""``ray_launch``: run a function once, as a Ray program, on an allocation of the cluster.

    from gpulaunch.backends.ray import ray_launch

    @ray_launch(gpus=16, remote=True)
    def pipeline():
        import ray
        ds = ray.data.range(10_000).map_batches(embed, num_gpus=1, concurrency=16)
        return ds.count()

    pipeline.distributed()          # -> [10000, None, ..., None], as the seed product

Where ``@distributed`` starts one torch rank per GPU, this reserves the same gang of nodes (a
placement group, all nodes or none, refused at once if the cluster can never hold it) and runs
the function a single time, on node 0, with Ray connected. Every Ray task and actor it starts
(Ray Data, Ray Train workers, your own) is placed inside the allocation: the function runs with
``placement_group_capture_child_tasks``, so it can use exactly what was reserved and nothing
more. The seed product builds a fresh Ray cluster on its nodes for this; on an existing Ray
cluster the allocation is the placement group.

The result list has one entry per GPU (rank), rank 0 holding the return value. A Python
exception comes back as itself with the remote traceback chained, as in ``@distributed``.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
import time

from ... import errors
from ...launch.payload import DEFAULT_MAX_ARG_BYTES, serialize_call
from ...launch.spec import DEFAULT_TIMEOUT, resolve
from . import placement
from .cluster import RayCluster, connect

PG_ENV = "GPULAUNCH_RAY_PLACEMENT_GROUP"


def _run_in_allocation(payload: bytes, env: dict):
    """Body of the driver task, on node 0 of the allocation."""
    import tempfile

    from ...launch.payload import load_call
    os.environ.update(env)
    with tempfile.NamedTemporaryFile(prefix="gpulaunch-payload-", suffix=".pkl") as f:
        f.write(payload)
        f.flush()
        func, args, kwargs = load_call(f.name)
    return func(*args, **kwargs)


class RayLaunchRun:
    """A ``ray_launch`` call in flight: ``status``, ``result()``, ``cancel()``."""

    def __init__(self, ray, pg, ref, layout, timeout, label):
        self._ray, self._pg, self._ref, self.layout = ray, pg, ref, layout
        self._timeout = timeout
        self._started = time.monotonic()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._outcome = None             # ("ok", value) or ("err", exception)
        self._state = "RUNNING"
        self.label = label

    @property
    def status(self) -> str:
        return self._state

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        while not self._done.is_set():
            step = 0.5 if end is None else max(0.0, min(0.5, end - time.monotonic()))
            self._collect(step)
            if end is not None and time.monotonic() >= end:
                break
        return self._done.is_set()

    def _collect(self, wait: float) -> None:
        ray = self._ray
        with self._lock:
            if self._done.is_set():
                return
            ready, _ = ray.wait([self._ref], timeout=wait)
            if not ready:
                if self._timeout is not None and time.monotonic() - self._started > self._timeout:
                    self._end("TIMED_OUT", ("err", errors.RunTimeoutError(
                        f"ray_launch {self.label} exceeded timeout={self._timeout:g} s and was "
                        "cancelled (with every task it started).")))
                return
            try:
                self._end("SUCCEEDED", ("ok", ray.get(self._ref)))
            except BaseException as e:  # noqa: BLE001
                self._end("FAILED", ("err", _unwrap(e)))

    def _end(self, state: str, outcome) -> None:
        if state != "SUCCEEDED":
            try:
                self._ray.cancel(self._ref, force=True, recursive=True)
            except Exception:
                pass
        try:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(self._pg)   # also ends what was left inside it
        except Exception:
            pass
        self._state, self._outcome = state, outcome
        self._done.set()

    def cancel(self) -> None:
        with self._lock:
            if not self._done.is_set():
                self._end("CANCELLED", ("err", errors.RunCancelledError(
                    f"ray_launch {self.label} was cancelled.")))

    def result(self, timeout: float | None = None) -> list:
        if not self.wait(timeout):
            raise TimeoutError(f"ray_launch {self.label} still running after {timeout} s")
        kind, value = self._outcome
        if kind == "err":
            raise value
        return [value] + [None] * (self.layout.world_size - 1)


def _unwrap(e: BaseException) -> BaseException:
    """Ray's RayTaskError -> the function's own exception, remote traceback chained."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException) and type(e).__name__.startswith("RayTaskError"):
        cause.__cause__ = errors.RemoteTraceback(f"\n\nTraceback from the ray_launch driver:\n{e}")
        try:
            cause.rank = 0
        except Exception:
            pass
        return cause
    if type(e).__name__ in ("TaskCancelledError",):
        return errors.RunCancelledError(str(e))
    return errors.LaunchError(f"ray_launch failed: {type(e).__name__}: {e}")


class RayLaunchFunction:
    def __init__(self, func, *, gpus=None, gpu_type=None, remote=False, timeout=DEFAULT_TIMEOUT,
                 cluster=None, env=None, max_arg_bytes=DEFAULT_MAX_ARG_BYTES):
        if not callable(func):
            raise errors.ConfigurationError(f"@ray_launch decorates a function; got {func!r}.")
        self.func = func
        self.gpus, self.gpu_type, self.timeout = gpus, gpu_type, timeout
        self.remote = remote or cluster is not None
        # Not remote: a private Ray instance on this host holds the allocation.
        self.cluster = RayCluster.coerce(cluster if cluster is not None else
                                         (None if remote else "local"))
        self.env = dict(env or {})
        self.max_arg_bytes = max_arg_bytes
        self._signature = inspect.signature(func)
        functools.update_wrapper(self, func)

    def __call__(self, *a, **kw):
        raise errors.ConfigurationError(
            f"{self.__name__} is a @ray_launch function: call {self.__name__}.distributed(...)"
            f" to run it on the allocation, or {self.__name__}.func(...) to run it here.")

    def submit(self, *args, **kwargs) -> RayLaunchRun:
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as e:
            raise errors.ArgumentError(f"{self.__name__}{self._signature}: {e}. Nothing was "
                                       "started.") from None
        from ...launch import hardware
        gpus = self.gpus
        if gpus is None and not self.remote:
            host = hardware.detect()
            gpus = len(host.gpus) if host.has_gpu else 2
        spec = resolve(hardware.detect(), gpus=gpus, gpu_type=self.gpu_type, remote=True,
                       timeout=self.timeout)
        blob = serialize_call(self.func, bound.args, bound.kwargs,
                              max_arg_bytes=self.max_arg_bytes)
        ray = connect(self.cluster)
        layout = placement.plan(placement.cluster_nodes(ray), gpus=spec.nproc_per_node,
                                gpu_type=spec.gpu_type, gpus_per_node=self.cluster.gpus_per_node,
                                autoscaling=self.cluster.autoscaling)
        pg, _ = placement.reserve(ray, layout, timeout=self.cluster.placement_timeout,
                                  name=f"gpulaunch-ray-launch-{self.__name__}")
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=0,
            placement_group_capture_child_tasks=True)
        env = dict(self.env, **{PG_ENV: pg.id.hex(), "GPULAUNCH_RAY_LAYOUT":
                                f"{layout.nnodes}x{layout.nproc_per_node}:{layout.device}"})
        task = ray.remote(_run_in_allocation).options(num_cpus=0, num_gpus=0, max_retries=0,
                                                      scheduling_strategy=strategy)
        ref = task.remote(blob, env)
        return RayLaunchRun(ray, pg, ref, layout, spec.timeout, self.__name__)

    def distributed(self, *args, **kwargs) -> list:
        run = self.submit(*args, **kwargs)
        try:
            run.wait()
        except BaseException:
            run.cancel()
            raise
        return run.result()


def ray_launch(num_accelerators=None, accelerator_type=None, remote: bool = False,
               timeout: float | None = DEFAULT_TIMEOUT, *, gpus=None, gpu_type=None,
               cluster=None, env: dict | None = None):
    """Run a function once as a Ray program on ``gpus`` GPUs of a Ray cluster (see module doc).

    Same arguments as ``@distributed`` (``num_accelerators``/``accelerator_type`` spellings
    included); ``cluster=`` as there. With ``remote=False`` and no ``cluster``, a private
    Ray instance on this host holds the allocation.
    """
    if callable(num_accelerators) and not isinstance(num_accelerators, int):
        return RayLaunchFunction(num_accelerators)
    if gpus is not None and num_accelerators is not None:
        raise errors.ConfigurationError("Pass either gpus= or num_accelerators=, not both.")
    if gpu_type is not None and accelerator_type is not None:
        raise errors.ConfigurationError("Pass either gpu_type= or accelerator_type=, not both.")
    n = gpus if gpus is not None else num_accelerators
    t = gpu_type if gpu_type is not None else accelerator_type

    def wrap(func):
        return RayLaunchFunction(func, gpus=n, gpu_type=t, remote=remote, timeout=timeout,
                                 cluster=cluster, env=env)
    return wrap


def current_placement_group():
    """Inside a ``ray_launch`` function: the allocation's placement group (Ray tasks started
    there are already placed in it; this is for APIs that take one explicitly)."""
    from ray.util.placement_group import get_current_placement_group
    return get_current_placement_group()


__all__ = ["ray_launch", "RayLaunchFunction", "RayLaunchRun", "current_placement_group",
           ]
