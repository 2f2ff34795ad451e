"""``launch()``: the one pipeline every entry point calls (the decorator's ``.distributed`` and
``.submit``, ``gpulaunch run``, ``ray_launch``).

    options ─resolve(host)─▶ spec ─fit check─▶ run dir ─payload─▶ callbacks.on_launch
        ─▶ backend.start() ─▶ announce ─▶ registry ─▶ (caller polls) ─▶ callbacks.on_end

It returns the started ``Run`` (``backends.base``); the caller follows it with
``RunHandle``. Nothing before ``backend.start()`` starts a process, so every user mistake is
raised here with nothing left behind.
"""

from __future__ import annotations

import os
import sys

from ..common import rundir
from ..common.payload import serialize_call
from ..common.records import Entry, LaunchRecord, NodePlacement
from ..common.rundir import hostname, write_json_atomic
from ..errors import ConfigurationError
from ..hardware import host as hardware_host
from ..options import LaunchOptions
from . import fitcheck
from .callbacks import Callbacks, LaunchContext, RunCallback
from .registry import ACTIVE
from .spec import resolve


def _local(record, run_dir, *, options, payload, hooks, stream, standby, write):
    from ..backends.local.run import LocalRun
    return LocalRun(record, run_dir, callbacks=hooks, stream=stream, write=write,
                    standby=standby)


def _pool(record, run_dir, *, options, payload, hooks, stream, standby, write):
    from ..backends.local.pool import PoolRun  # the warm rank pool (keep_alive=)
    return PoolRun(record, run_dir, keep_alive=record.spec.keep_alive, callbacks=hooks,
                   stream=stream, write=write)


def _ray(record, run_dir, *, options, payload, hooks, stream, standby, write):
    from ..backends.ray.run import RayRun
    return RayRun(record, run_dir, payload, cluster=options.cluster, callbacks=hooks,
                  stream=stream, write=write)


def _ray_program(record, run_dir, *, options, payload, hooks, stream, standby, write):
    from ..backends.ray.program_run import RayProgramRun
    return RayProgramRun(record, run_dir, payload, cluster=options.cluster, callbacks=hooks)


# The backend registry: a launch's ``backend`` name -> what builds its run (a RunController).
BACKENDS = {"local": _local, "pool": _pool, "ray": _ray, "ray_program": _ray_program}


def choose_backend(requested: str | None, spec, *, has_payload: bool, nnodes: int) -> str:
    """The registry name of a launch's backend, from its spec: Ray when it is remote, the warm
    pool for a function with keep_alive on one host, else the local node agent."""
    name = requested or ("ray" if spec.remote else "local")
    if name not in BACKENDS or name == "pool":
        raise ValueError(f"backend {name!r} is not one of {sorted(set(BACKENDS) - {'pool'})}")
    if name == "local" and spec.keep_alive and has_payload and nnodes == 1:
        return "pool"
    return name


def default_callbacks(options: LaunchOptions) -> list[RunCallback]:
    """The side concerns every launch gets: MLflow tracking when it is on, the notebook
    panel inside a Jupyter kernel."""
    from ..notebook.callback import panel_callback
    from ..tracking.callback import tracking_callback
    cbs = [tracking_callback(options.tracking), panel_callback(options.panel)]
    return [cb for cb in cbs if cb is not None]


def _refuse_nested(label: str) -> None:
    if os.environ.get("GPULAUNCH_RUN_DIR") and os.environ.get("RANK") is not None:
        raise ConfigurationError(
            f"{label}.distributed() was called inside a rank of a running gpulaunch job. Nested "
            "launches would multiply processes per GPU; call the function directly there "
            f"({label}.func(...)).")


def launch(options: LaunchOptions, entry: Entry, *, label: str, call=None, stream: bool = True,
           backend: str | None = None, standby: bool = False, write=None,
           callbacks: list[RunCallback] | None = None, placement: NodePlacement | None = None):
    """Start one run and return it (started, registered, announced).

    call: (func, args, kwargs, arg_names) for a function entry; it is pickled here, so an
        argument that cannot travel is refused by name before anything starts.
    backend: "local", "ray" or "ray_program" (``BACKENDS``); default: from the spec
        (``choose_backend``: Ray when remote; the warm pool for keep_alive on one host). The
        Ray connection recipe (``cluster=``, which may hold runtime_env secrets) is the one
        setting that is handed to the Ray backends as an object and never written to a record.
    standby: the local backend may use (and afterwards restart) a standby agent — for callers
        that launch again and again (the Python API), not for one-shot CLI launches.
    placement: this node's place in a multi-node job that every node launches itself
        (``gpulaunch run --nnodes``); the spec's ``nnodes`` follows it.
    """
    _refuse_nested(label)
    host = hardware_host.detect()
    spec = resolve(options, host)
    if placement is not None and placement.nnodes > 1:
        import dataclasses
        spec = dataclasses.replace(spec, nnodes=placement.nnodes)
    backend = choose_backend(backend, spec, has_payload=call is not None,
                             nnodes=placement.nnodes if placement is not None else 1)
    fit = fitcheck.check_launch(options.plan, spec, host)
    payload = None
    if call is not None:
        func, args, kwargs, arg_names = call
        payload = serialize_call(func, args, kwargs, arg_names=arg_names,
                                 max_arg_bytes=options.max_arg_bytes)
    from .cloud_notices import watch_callback
    watch = watch_callback(options)        # preempt_watch=: a thread per run, from its start
    run_dir = rundir.create(label)
    if payload is not None and backend in ("local", "pool"):
        with open(os.open(run_dir.payload, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600),
                  "wb") as f:
            f.write(payload)
    if fit is not None:
        import dataclasses
        write_json_atomic(run_dir.path / "plan.json", dataclasses.asdict(fit))
    hooks = Callbacks((default_callbacks(options) if callbacks is None else list(callbacks))
                      + ([watch] if watch is not None else []))
    ctx = LaunchContext(run_dir, label, spec, entry, options,
                        remote=backend not in ("local", "pool"))
    hooks.on_launch(ctx)
    record = LaunchRecord(run_id=run_dir.run_id, label=label, spec=spec, entry=entry,
                          backend="local" if backend == "pool" else backend,
                          caller_pid=os.getpid(), host=hostname(),
                          cwd=os.getcwd(), argv=tuple(sys.argv),
                          extensions=dict(hooks.extensions),
                          **({"placement": placement} if placement is not None else {}))
    run = BACKENDS[backend](record, run_dir, options=options, payload=payload, hooks=hooks,
                            stream=stream, standby=standby, write=write)
    run.begin()                 # the controller: start, then on_start (or on_end if it failed)
    ACTIVE.add(run)
    _announce(run, fit)
    _prune_old_runs(run_dir)
    return run


def _prune_old_runs(run_dir) -> None:
    """Retention of old run directories (common/retention.py), in a daemon thread: bounded per
    launch and never able to fail or slow it. This caller's runs in flight are protected."""
    import threading

    from ..common import retention
    protect = [str(run_dir.path)] + [str(getattr(r, "run", r).path) for r in ACTIVE.runs()
                                     if hasattr(getattr(r, "run", None), "path")]
    threading.Thread(target=retention.prune_quietly, args=(protect,), daemon=True,
                     name="gpulaunch-prune").start()


def _announce(run, fit) -> None:
    if os.environ.get("GPULAUNCH_QUIET"):
        return
    sys.stdout.write(f"gpulaunch: run {run.run.run_id}: {run.describe()}\n")
    if fit is not None:
        sys.stdout.write(f"gpulaunch: plan: {fit.message}\n")
    sys.stdout.flush()

