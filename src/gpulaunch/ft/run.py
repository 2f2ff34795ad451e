"""The blocking calls that run a function as replica groups: ``ft.run_replicas(fn, ...)`` and
``@distributed(replicas=...)``'s ``.distributed()``. Both start a :class:`ReplicaGroups`
(``replicas.py``), poll it until every group has ended, and return its ``ReplicasResult``.

    @distributed(replicas=2, timeout=600)
    def train(steps):
        r = ft.replicated(model, optimizer)
        ...
    result = train.distributed(200)     # a ReplicasResult: which groups failed, when, and
                                        # how many steps each missed; result.results per group

The decorator's settings other than ``replicas`` describe each group's launch and go to it as
they are (``timeout``, ``env``, ``stream_logs``, ``hang_timeout``, ...); the ``Replicas``
record (``common/replica_spec.py``) holds the run's own.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from ..errors import RunError
from ..options import LaunchOptions
from .elastic import CapacityLike
from .lighthouse import Lighthouse
from .replicas import ReplicaGroups
from .result import ReplicasResult

# Settings of the decorator handled here (or refused by replica_spec.conflicts): not passed to
# each group's launch as they are.
_NOT_PER_GROUP = {"gpus", "replicas", "env", "remote", "cluster", "keep_alive", "max_restarts"}


def run_replicas(fn: Callable, *args, replicas: int | tuple[int, int] = 2,
                 max_group_restarts: int = 3, lighthouse: str | Lighthouse | None = None,
                 poll_s: float = 0.1, on_poll: Callable[[ReplicaGroups], None] | None = None,
                 node_lost_timeout: float | None = None, capacity: CapacityLike = None,
                 **options) -> ReplicasResult:
    """Run ``fn(*args)`` as ``replicas`` fault-tolerant replica groups and block until all end.

    ``fn`` builds its model and calls :func:`gpulaunch.ft.replicated` (see that module). Each
    group is a launch of ``ranks_per_group`` ranks (default 1; more: HSDP, FSDP2 inside the
    group with ``replicated(..., shard=True)``); a rank that dies fails its whole group. A
    group that fails (crash, SIGKILL, error) is launched again, up to ``max_group_restarts``
    times, while the others keep training; it heals from a live peer. Keyword arguments that
    are not settings here are passed to ``fn`` if its signature takes them, else used as
    launch settings (``timeout=``, ``shutdown_grace=``, ``extra_env=``, ...).

    ``replicas=(min, max)`` makes the size elastic (``elastic.py``): ``max`` groups (or as many
    as ``capacity`` allows), a failed group started again only when ``capacity``
    (a :class:`~gpulaunch.ft.Capacity`, an int or a callable; default: always ``max``) allows;
    one not started within ``node_lost_timeout`` seconds (default 60) leaves the run smaller,
    and a group is started again when capacity returns. Below ``min`` for that long, the run
    stops with :class:`~gpulaunch.ft.ReplicasBelowMinError`. ``result.size_changes`` lists
    every change.

    Returns a :class:`ReplicasResult`; raises the last group's error if no group finished.
    """
    import inspect
    target = getattr(fn, "func", fn)
    params = inspect.signature(target).parameters
    fn_kwargs = {k: options.pop(k) for k in list(options) if k in params}
    return run_groups(fn, args, fn_kwargs, replicas=replicas,
                      max_group_restarts=max_group_restarts, lighthouse=lighthouse,
                      node_lost_timeout=node_lost_timeout, capacity=capacity, poll_s=poll_s,
                      on_poll=on_poll, **options)


def run_groups(fn: Callable, args: tuple, fn_kwargs: dict, *, poll_s: float = 0.1,
               on_poll: Callable[[ReplicaGroups], None] | None = None,
               **settings) -> ReplicasResult:
    """:func:`run_replicas` with ``fn``'s keyword arguments apart from the settings (what
    ``@distributed(replicas=...)`` calls: there, the function's arguments are already bound)."""
    groups = ReplicaGroups(fn, args, fn_kwargs, **settings)
    groups.start()
    last_error: BaseException | None = None
    try:
        while not groups.poll():
            if on_poll is not None:
                on_poll(groups)
            time.sleep(poll_s)
    except BaseException as e:
        last_error = e
        groups.stop()
        raise
    finally:
        if last_error is None:
            result = groups.finish()
        else:
            groups.finish()
    if not result.results:
        raise RunError(f"every replica group failed and none finished:\n{result.summary()}")
    return result


def launch_settings(options: LaunchOptions) -> dict:
    """The settings each replica group's launch takes from the decorator: the ones changed
    from their default (the group launch has defaults of its own for the others)."""
    out = {}
    defaults = LaunchOptions()           # checked defaults (tracking=None becomes a record)
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if f.name not in _NOT_PER_GROUP and value != getattr(defaults, f.name):
            out[f.name] = value
    if options.env:
        out["extra_env"] = dict(options.env)
    return out


def group_settings(options: LaunchOptions) -> dict:
    """Every setting ``run_groups`` takes from a decorator with ``replicas=``: the run's own
    (the ``Replicas`` record), each group's size (``gpus``: its ranks, default 1; more than one
    is HSDP, see ``sharded.py``) and each group's launch settings."""
    return {**options.replicas.run_kwargs(), "ranks_per_group": options.gpus or 1,
            **launch_settings(options)}


def run_decorated(function, args: tuple, kwargs: dict) -> ReplicasResult:
    """Run a ``DistributedFunction`` that has ``replicas=`` set; block until every group ends."""
    call_args, call_kwargs, _ = function._bind(args, kwargs)
    return run_groups(function.func, tuple(call_args), dict(call_kwargs),
                      **group_settings(function.options))
