"""The public API, in one place: every name ``import gpulaunch`` offers is defined or
re-exported here (``__all__``), the rest of the package is internals.

The decorator users touch: ``@distributed(...)`` and ``DistributedFunction``.

    @distributed(gpus=8, gpu_type="H100")
    def train(lr): ...
    results = train.distributed(lr=3e-4)      # blocks; one entry per rank, by global rank
    handle = train.submit(lr=3e-4)            # returns at once; handle.result() later

Every setting is a ``LaunchOptions`` field (``options.py``); everything the user got wrong is
reported before any process starts. Launching is ``caller.pipeline.launch``.
"""

from __future__ import annotations

import functools
import inspect

from . import options as _options
from .backends.ray.cluster import RayCluster, ray_init  # imports no ray until used
from .caller.handle import RunHandle
from .common.records import Entry
from .errors import ArgumentError, ConfigurationError

__all__ = ["distributed", "DistributedFunction", "RunHandle", "ray_launch", "RayLaunchFunction",
           "ray_init", "RayCluster", "shutdown"]


class DistributedFunction:
    """A function prepared to run on several ranks. Call ``.distributed(...)`` to run it."""

    # what this object runs on (``ray_launch`` sets "ray_program")
    _backend: str | None = None
    _kind = "@distributed"

    def __init__(self, func, opts: _options.LaunchOptions | None = None):
        if not callable(func):
            raise ConfigurationError(f"{self._kind} decorates a function; got {func!r}.")
        self.func = func
        self.options = opts if opts is not None else _options.LaunchOptions()
        self._signature = inspect.signature(func)
        functools.update_wrapper(self, func)
        # The host too, now (a GPU type or count it cannot give fails at decoration time); it
        # is checked again at launch, since CUDA_VISIBLE_DEVICES may change in between.
        self._spec_here()

    def _spec_here(self):
        from .caller.spec import resolve
        from .hardware.host import detect
        return resolve(self.options, detect())

    def __getattr__(self, name: str):
        # Every setting reads as an attribute (``f.gpus``, ``f.timeout``, the seed's
        # ``f.num_accelerators``...), straight from the one settings object.
        if name != "options" and "options" in self.__dict__:
            opts = self.__dict__["options"]
            if name in _options.ALIASES or name in _options.field_names():
                return getattr(opts, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def gpus_per_node(self) -> int:
        """Ranks per node this launch would get here now (the host is checked again at launch)."""
        return self._spec_here().nproc_per_node

    def __call__(self, *args, **kwargs):
        raise ConfigurationError(
            f"{self.__name__} is a {self._kind} function: call "
            f"{self.__name__}.distributed(...) to run it, or "
            f"{self.__name__}.func(...) to run it once in this process.")

    def with_overrides(self, *args, **changes) -> "DistributedFunction":
        """A copy with some settings changed. Any setting can be set back to its default,
        ``None`` included (``gpus=None``: every GPU again; ``timeout=None``: no limit).
        Positionally, as the seed: (num_accelerators, accelerator_type, remote, timeout)."""
        for name, value in zip(_options.POSITIONAL, args):
            if value is not None or name == "timeout":
                changes.setdefault(name, value)
        return type(self)(self.func, self.options.replace(**changes))

    def _bind(self, args, kwargs):
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as e:
            raise ArgumentError(f"{self.__name__}{self._signature}: {e}. Nothing was started.") \
                from None
        bound.apply_defaults()
        names = {}
        params = list(self._signature.parameters.values())
        for i in range(len(bound.args)):
            if i < len(params) and params[i].kind in (params[i].POSITIONAL_ONLY,
                                                      params[i].POSITIONAL_OR_KEYWORD):
                names[i] = f"argument {params[i].name!r}"
        return bound.args, bound.kwargs, names

    def _launch(self, args, kwargs, *, stream: bool):
        from .caller.pipeline import launch
        call_args, call_kwargs, names = self._bind(args, kwargs)
        return launch(self.options, Entry("function"), label=self.__name__,
                      call=(self.func, call_args, call_kwargs, names), stream=stream,
                      backend=self._backend, standby=True)

    def submit(self, *args, **kwargs) -> RunHandle:
        """Start the run and return at once with a ``RunHandle``; logs are not streamed
        (read them with ``handle.logs()``)."""
        if self.options.replicas is not None:
            raise ConfigurationError(
                f"{self.__name__}.submit(...) with replicas=: a replica run is supervised by "
                f"this process until every group ends; call {self.__name__}.distributed(...) "
                "(in a thread if it must not block).")
        return RunHandle(self._launch(args, kwargs, stream=False), background=True)

    def distributed(self, *args, **kwargs) -> list:
        """Run on every rank and block; return the list of per-rank results (global rank
        order), or raise the root-cause error. Ctrl-C / a notebook interrupt stops every rank.
        With ``replicas=``: a ``gpulaunch.ft.ReplicasResult`` (each group's results, failures
        and size changes) once every replica group has ended."""
        if self.options.replicas is not None:
            from .ft.run import run_decorated as run_replica_groups
            return run_replica_groups(self, args, kwargs)
        run = self._launch(args, kwargs, stream=self.options.stream_logs != "none")
        return RunHandle(run, background=False).follow()

    def __repr__(self) -> str:
        o = self.options
        return (f"<DistributedFunction {self.__name__} gpus={o.gpus} gpu_type={o.gpu_type} "
                f"remote={o.remote}>")


def decorator(cls):
    """Build a decorator factory for ``cls`` whose keyword arguments are the LaunchOptions
    fields (and the seed's positional order and aliases)."""
    def factory(*args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs \
                and not isinstance(args[0], (int, str)):
            return cls(args[0])                               # bare @distributed
        opts = _options.build(*args, **kwargs)
        return lambda func: cls(func, opts)
    factory.__signature__ = _options.signature()
    return factory


distributed = decorator(DistributedFunction)
distributed.__name__ = "distributed"
distributed.__doc__ = """Make a function run on several ranks: ``@distributed(gpus=8, gpu_type="H100")``.

Also usable bare, as ``@distributed``. Positionally, as the seed product:
``distributed(num_accelerators, accelerator_type, remote, timeout)``. Every keyword is a
``gpulaunch.options.LaunchOptions`` field:

""" + "\n".join(f"    {name} (default {default!r}): {doc}"
                for name, default, doc in _options.describe())


class RayLaunchFunction(DistributedFunction):
    """``@ray_launch``: like ``DistributedFunction``, run once as a Ray program."""

    _backend = "ray_program"
    _kind = "@ray_launch"

    def _launch(self, args, kwargs, *, stream: bool):
        opts = self.options
        if opts.replicas is not None:
            raise ConfigurationError("@ray_launch with replicas=: replica groups are local "
                                     "launches; use @distributed(replicas=...)")
        if not opts.remote:
            # Not remote: a private Ray instance on this host holds the allocation, sized to
            # this host's GPUs (or 2 CPU slots without one).
            from .hardware.host import detect
            host = detect()
            gpus = opts.gpus or (len(host.gpus) if host.has_gpu else 2)
            opts = opts.replace(gpus=gpus, cluster="local")
        saved, self.options = self.options, opts
        try:
            return super()._launch(args, kwargs, stream=stream)
        finally:
            self.options = saved


ray_launch = decorator(RayLaunchFunction)
ray_launch.__name__ = "ray_launch"
ray_launch.__doc__ = """Run a function once as a Ray program on ``gpus`` GPUs of a Ray cluster
(see ``gpulaunch.backends.ray.ray_launch``). Same settings as ``@distributed`` (the
``num_accelerators``/``accelerator_type`` spellings included); with ``remote=False`` and no
``cluster``, a private Ray instance on this host holds the allocation."""


def shutdown() -> None:
    """Release everything this process keeps between calls: the warm pool's ranks (and the
    GPUs they hold, ``keep_alive=``) and the standby agent."""
    from .backends.local.pool_registry import POOLS
    from .backends.local.standby import STANDBY
    POOLS.close("gpulaunch.shutdown()")
    STANDBY.close()
