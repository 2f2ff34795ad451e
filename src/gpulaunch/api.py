"""The decorator users touch: ``@distributed(...)``, ``DistributedFunction`` and ``RunHandle``.

    @distributed(gpus=8, gpu_type="H100")
    def train(lr): ...
    results = train.distributed(lr=3e-4)      # blocks; one entry per rank, by global rank
    handle = train.submit(lr=3e-4)            # returns at once; handle.result() later

Everything the user got wrong is reported here, before any process starts.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import sys
import threading

from .errors import ArgumentError, ConfigurationError, LaunchError
from .launch import fitcheck, hardware, rundir
from .launch.logstream import tail_text
from .launch.payload import DEFAULT_MAX_ARG_BYTES, serialize_call
from .launch.spec import DEFAULT_SHUTDOWN_GRACE, DEFAULT_TIMEOUT, LaunchSpec, resolve

_UNSET = object()


def _stop_quietly(run) -> None:
    """Stop a run whose following failed. Stopping may hit the same fault (a deleted run
    directory, a lost connection) once the ranks are signalled; the caller gets the first."""
    try:
        run.stop("cancelled")
    except Exception:  # noqa: BLE001
        pass
    finally:
        run.finished = True


def _lost_track(run_id: str, run_dir: str, e: BaseException) -> LaunchError:
    """The error for a run whose following failed in the caller (not in a rank)."""
    return LaunchError(f"gpulaunch lost track of run {run_id} while following it "
                       f"({type(e).__name__}: {e}); every rank was stopped. Run directory: "
                       f"{run_dir}", run_dir=run_dir)


class RunHandle:
    """A run in flight: ``status``, ``result()``, ``logs()``, ``cancel()``, ``run_dir``."""

    def __init__(self, run, *, background: bool):
        self._run = run
        self.run_id = run.run.run_id
        self.run_dir = str(run.run.path)
        self._tracker = getattr(run, "tracker", None)
        self._thread = None
        self._follow_error: BaseException | None = None
        if background:
            self._thread = threading.Thread(target=self._follow, name=f"gpulaunch-{self.run_id}",
                                            daemon=True)
            self._thread.start()

    def _follow(self) -> None:
        """The background thread: step the run until it ends. If following it fails (a bug of
        ours, a lost cluster connection), the run must not be left going unobserved with
        ``done()`` False forever: stop every rank and keep the error for ``result()``."""
        try:
            self._run.wait()
        except BaseException as e:  # noqa: BLE001 - reported by result()
            self._follow_error = e
            _stop_quietly(self._run)

    @property
    def status(self) -> str:
        """PENDING, RUNNING, SUCCEEDED, FAILED, CANCELLED or TIMED_OUT."""
        return self._run.state

    @property
    def mlflow_run_id(self) -> str | None:
        """The MLflow run of this launch (None when tracking is off or its store failed)."""
        if self._tracker is None:
            return None
        info = self._tracker.wait_ready()
        return info["run_id"] if info else None

    def done(self) -> bool:
        return self._run.finished

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the run ends (or ``timeout`` seconds pass); True if it ended."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return self._run.wait(timeout=timeout)

    def result(self, timeout: float | None = None) -> list:
        """The per-rank results ordered by global rank, or the run's error raised here."""
        if not self.wait(timeout):
            raise TimeoutError(f"run {self.run_id} still running after {timeout} s "
                               "(this did not stop it; call cancel() to stop it)")
        if self._follow_error is not None:
            e = self._follow_error
            raise _lost_track(self.run_id, self.run_dir, e) from e
        return self._run.outcome()

    def cancel(self) -> None:
        """Stop every rank now (SIGTERM, then SIGKILL after the grace period)."""
        self._run.stop("cancelled")

    def logs(self, rank: int | None = None, lines: int | None = None) -> str:
        """The log of one rank, or of every rank (prefixed), from the latest attempt."""
        run = self._run.run
        attempts = run.attempts()
        if not attempts:
            return ""
        attempt = attempts[-1]
        ranks = [rank] if rank is not None else range(self._run.spec.world_size)
        chunks = []
        for r in ranks:
            text = tail_text(run.rank_file(attempt, r, "log"), lines or 10**9, max_bytes=1 << 26)
            if rank is not None:
                return text
            chunks.extend(f"[rank {r}] {line}" for line in text.splitlines())
        return "\n".join(chunks)

    def __repr__(self) -> str:
        return f"<RunHandle {self.run_id} {self.status}>"


class DistributedFunction:
    """A function prepared to run on several ranks. Call ``.distributed(...)`` to run it."""

    def __init__(self, func, *, gpus=None, gpu_type=None, remote=False, timeout=DEFAULT_TIMEOUT,
                 hang_timeout=None, max_restarts=0, shutdown_grace=DEFAULT_SHUTDOWN_GRACE,
                 stream_logs="all", env=None, max_arg_bytes=DEFAULT_MAX_ARG_BYTES, cluster=None,
                 plan=None, tracking=None):
        if not callable(func):
            raise ConfigurationError(f"@distributed decorates a function; got {func!r}.")
        self.func = func
        self.gpus = gpus
        self.gpu_type = gpu_type
        self.remote = remote
        self.timeout = timeout
        self.hang_timeout = hang_timeout
        self.max_restarts = max_restarts
        self.shutdown_grace = shutdown_grace
        self.stream_logs = stream_logs
        self.env = dict(env) if env else None
        self.max_arg_bytes = max_arg_bytes
        self.plan = fitcheck.validate(plan)
        self.cluster = cluster           # a Ray address or RayCluster(...); implies remote=True
        if cluster is not None:
            from .backends.ray.cluster import RayCluster
            RayCluster.coerce(cluster)   # a bad setting fails here, at decoration time
        from .tracking import settings as _tracking_settings
        self.tracking = _tracking_settings.normalize(tracking)   # bad values fail here
        if self.tracking.enabled:
            _tracking_settings.enabled(self.tracking)   # tracking=True without mlflow: say so now
        self._signature = inspect.signature(func)
        functools.update_wrapper(self, func)
        # Check the settings now (bad values fail at decoration time, not at the first call);
        # the host is checked again at launch since CUDA_VISIBLE_DEVICES may change.
        self._resolve()

    # the seed product's newer spellings
    num_accelerators = property(lambda self: self.gpus)
    accelerator_type = property(lambda self: self.gpu_type)

    @property
    def gpus_per_node(self) -> int:
        return self._resolve().nproc_per_node

    def _settings(self) -> dict:
        return dict(gpus=self.gpus, gpu_type=self.gpu_type, remote=self.remote,
                    timeout=self.timeout, hang_timeout=self.hang_timeout,
                    max_restarts=self.max_restarts, shutdown_grace=self.shutdown_grace,
                    stream_logs=self.stream_logs, env=self.env, max_arg_bytes=self.max_arg_bytes,
                    cluster=self.cluster, plan=self.plan, tracking=self.tracking)

    def _resolve(self) -> LaunchSpec:
        s = self._settings()
        s.pop("max_arg_bytes")
        s.pop("plan")
        s.pop("tracking")
        if s.pop("cluster") is not None:
            s["remote"] = True
        return resolve(hardware.detect(), **s)

    def __call__(self, *args, **kwargs):
        raise ConfigurationError(
            f"{self.__name__} is a @distributed function: call "
            f"{self.__name__}.distributed(...) to run it on every rank, or "
            f"{self.__name__}.func(...) to run it once in this process.")

    def with_overrides(self, gpus=None, gpu_type=None, remote=None, timeout=_UNSET, *,
                       num_accelerators=None, accelerator_type=None, **other):
        """A copy with some settings changed (``timeout=None`` removes the limit)."""
        s = self._settings()
        gpus = _merge_alias("gpus", gpus, "num_accelerators", num_accelerators)
        gpu_type = _merge_alias("gpu_type", gpu_type, "accelerator_type", accelerator_type)
        if gpus is not None:
            s["gpus"] = gpus
        if gpu_type is not None:
            s["gpu_type"] = gpu_type
        if remote is not None:
            s["remote"] = remote
        if timeout is not _UNSET:
            s["timeout"] = timeout
        unknown = set(other) - set(s)
        if unknown:
            raise ConfigurationError(f"with_overrides() got unknown settings {sorted(unknown)}; "
                                     f"known: {sorted(s)}.")
        s.update(other)
        return DistributedFunction(self.func, **s)

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

    def submit(self, *args, **kwargs) -> RunHandle:
        """Start the run and return at once with a ``RunHandle``; logs are not streamed
        (read them with ``handle.logs()``)."""
        run = self._start(args, kwargs, stream=False)
        return RunHandle(run, background=True)

    def distributed(self, *args, **kwargs) -> list:
        """Run on every rank and block; return the list of per-rank results (global rank
        order), or raise the root-cause error. Ctrl-C / a notebook interrupt stops every rank."""
        run = self._start(args, kwargs, stream=self.stream_logs != "none")
        try:
            run.wait()
        except Exception as e:  # following the run failed (not the run): same as submit()
            _stop_quietly(run)
            raise _lost_track(run.run.run_id, str(run.run.path), e) from e
        except BaseException:  # KeyboardInterrupt / a notebook's stop button: stop every rank
            run.stop("cancelled")
            raise
        return run.outcome()

    def _start(self, args, kwargs, *, stream: bool):
        if os.environ.get("GPULAUNCH_RUN_DIR") and os.environ.get("RANK") is not None:
            raise ConfigurationError(
                f"{self.__name__}.distributed() was called inside a rank of a running gpulaunch "
                "job. Nested launches would multiply processes per GPU; call the function "
                f"directly there ({self.__name__}.func(...)).")
        spec = self._resolve()
        call_args, call_kwargs, names = self._bind(args, kwargs)
        fit = fitcheck.check_launch(self.plan, spec, hardware.detect())
        blob = serialize_call(self.func, call_args, call_kwargs, arg_names=names,
                              max_arg_bytes=self.max_arg_bytes)
        if spec.remote:
            from .backends.ray.run import RayRun
            return RayRun(spec, blob, {"kind": "function"}, label=self.__name__,
                          cluster=self.cluster, stream=stream, tracking=self.tracking).start()
        run = rundir.create(self.__name__)
        with open(os.open(run.payload, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(blob)
        if fit is not None:
            rundir.write_json_atomic(run.path / "plan.json", dataclasses.asdict(fit))
        _announce(spec, run, fit)
        entry = {"kind": "function"}
        # tracking hook: the MLflow run of this call (gpulaunch.tracking; None when off)
        from .tracking.caller import begin as _begin_tracking
        tracker = _begin_tracking(self.tracking, run, label=self.__name__, spec=spec, entry=entry)
        from .backends.local.launcher import LocalRun
        return LocalRun(spec, run, entry, label=self.__name__, stream=stream,
                        tracker=tracker, standby=True).start()

    def __repr__(self) -> str:
        return (f"<DistributedFunction {self.__name__} gpus={self.gpus} "
                f"gpu_type={self.gpu_type} remote={self.remote}>")


def _announce(spec: LaunchSpec, run, fit=None) -> None:
    if os.environ.get("GPULAUNCH_QUIET"):
        return
    if spec.device == "cpu":
        what = f"{spec.world_size} CPU worker processes (no GPU on this host; gloo backend)"
    else:
        what = f"{spec.world_size} GPU rank(s) ({spec.gpu_type.name if spec.gpu_type else 'GPU'}, nccl)"
        if spec.world_size == 1:
            what += "; @distributed is meant for several GPUs, this runs one"
    sys.stdout.write(f"gpulaunch: run {run.run_id}: {what}\n")
    if fit is not None:
        sys.stdout.write(f"gpulaunch: plan: {fit.message}\n")
    sys.stdout.flush()


def _merge_alias(name, value, alias, alias_value):
    if value is not None and alias_value is not None:
        raise ConfigurationError(f"Pass either {name}= or {alias}=, not both.")
    return alias_value if alias_value is not None else value


def distributed(num_accelerators=None, accelerator_type=None, remote: bool = False,
                timeout: float | None = DEFAULT_TIMEOUT, *, gpus=None, gpu_type=None,
                hang_timeout: float | None = None, max_restarts: int = 0,
                shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE, stream_logs="all",
                env: dict | None = None, max_arg_bytes: int = DEFAULT_MAX_ARG_BYTES,
                cluster=None, plan: dict | None = None, tracking=None):
    """Make a function run on several ranks: ``@distributed(gpus=8, gpu_type="H100")``.

    gpus / num_accelerators: ranks on this host; None = every GPU here (2 CPU workers on a
        host without GPUs).
    gpu_type / accelerator_type: refuse to run unless the host has this GPU ("H100", "h200",
        GPUType.A100, or "GPU_8xH100" which also sets the count).
    remote: run on a Ray cluster (``gpulaunch[ray]``) instead of this host; gpus= is then the
        total over the cluster's nodes (docs/multi-node.md).
    cluster: which Ray cluster and how: an address ("auto", "head:6379", "ray://...",
        "local") or ``gpulaunch.RayCluster(...)``; implies remote=True. Default: from
        $GPULAUNCH_RAY_ADDRESS, $RAY_ADDRESS, else "auto".
    timeout: seconds before every rank is stopped and ``RunTimeoutError`` raised (None: no limit).
    hang_timeout: seconds a rank may stay on the same line before the run is declared hung and
        every rank's stack reported (``HangError``). Off by default.
    max_restarts: restart the whole group this many times after a failure.
    stream_logs: "all" ranks, "rank0", "none", or a list of ranks to print in the caller.
    env: extra environment variables for the ranks.
    plan: check GPU memory before launching: ``{"model": "llama-3.1-8b", "strategy": "fsdp",
        "seq_len": 4096, ...}`` (any ``gpulaunch.planner.plan()`` argument). A strategy that would
        not fit is refused with what would (``WontFitError``); ``"on_fail": "warn"`` only warns.
    tracking: the MLflow run of each call (``gpulaunch.tracking``). None: on when mlflow is
        installed (``GPULAUNCH_TRACKING=0`` turns it off); False: off; True: required; a string:
        the experiment name; or ``gpulaunch.tracking.Tracking(experiment=, run_name=, ...)``.

    Also usable bare, as ``@distributed``.
    """
    if callable(num_accelerators) and not isinstance(num_accelerators, int):
        # bare @distributed
        return DistributedFunction(num_accelerators)
    n = _merge_alias("gpus", gpus, "num_accelerators", num_accelerators)
    t = _merge_alias("gpu_type", gpu_type, "accelerator_type", accelerator_type)

    def wrap(func):
        return DistributedFunction(func, gpus=n, gpu_type=t, remote=remote, timeout=timeout,
                                   hang_timeout=hang_timeout, max_restarts=max_restarts,
                                   shutdown_grace=shutdown_grace, stream_logs=stream_logs,
                                   env=env, max_arg_bytes=max_arg_bytes, cluster=cluster,
                                   plan=plan, tracking=tracking)
    return wrap
