"""LaunchSpec: the validated, immutable description of one launch. Pure data.

``resolve()`` turns what the user wrote (``gpus=``, ``gpu_type=``, ``timeout=``...) plus what the
host has into a ``LaunchSpec`` or raises a ``UserError`` that says what is wrong and what to do.
Nothing here starts a process.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os

from ..compute import AcceleratorType, GPUType
from ..errors import ConfigurationError, GPUTypeError, GPUValidationError
from .hardware import HostInfo, max_cpu_workers

DEFAULT_TIMEOUT = 10800.0          # 3 h, as the seed product
DEFAULT_SHUTDOWN_GRACE = 5.0       # SIGTERM -> SIGKILL when stopping ranks
DEFAULT_CPU_WORKERS = 2            # gpus=None on a host without GPUs
LOG_MODES = ("all", "rank0", "none")


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    nproc_per_node: int
    device: str                       # "cuda" or "cpu"
    gpu_type: GPUType | None = None
    nnodes: int = 1
    timeout: float | None = DEFAULT_TIMEOUT
    hang_timeout: float | None = None
    max_restarts: int = 0
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE
    stream_logs: str | tuple[int, ...] = "all"
    remote: bool = False
    env: tuple[tuple[str, str], ...] = ()

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"

    def shows_rank(self, rank: int) -> bool:
        if self.stream_logs == "all":
            return True
        if self.stream_logs == "none":
            return False
        if self.stream_logs == "rank0":
            return rank == 0
        return rank in self.stream_logs


def _check_count(name: str, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise GPUValidationError(f"{name} must be a positive int (or None for every GPU here), "
                                 f"got {value!r} of type {type(value).__name__}.")
    if value < 1:
        raise GPUValidationError(f"{name} must be at least 1, got {value}. Use {name}=None to "
                                 "use every GPU on this host.")
    return int(value)


def _check_seconds(name: str, value, allow_none: bool = True) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or value <= 0:
        raise ConfigurationError(f"{name} must be a positive number of seconds"
                                 f"{' or None' if allow_none else ''}, got {value!r}.")
    return float(value)


def normalize_stream_logs(value) -> str | tuple[int, ...]:
    if value is True:
        return "all"
    if value is False or value is None:
        return "none"
    if isinstance(value, str):
        v = value.lower()
        if v in ("0", "rank0", "rank 0"):
            return "rank0"
        if v in LOG_MODES:
            return v
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return (int(value),)
    if isinstance(value, (list, tuple, set, frozenset)) and all(
            isinstance(r, numbers.Integral) and not isinstance(r, bool) for r in value):
        return tuple(sorted(int(r) for r in value))
    raise ConfigurationError(f"stream_logs must be 'all', 'rank0', 'none', True/False, a rank or a "
                             f"list of ranks; got {value!r}.")


def resolve(host: HostInfo, *, gpus=None, gpu_type=None, remote: bool = False,
            timeout=DEFAULT_TIMEOUT, hang_timeout=None, max_restarts: int = 0,
            shutdown_grace=DEFAULT_SHUTDOWN_GRACE, stream_logs="all", env=None,
            nnodes: int = 1) -> LaunchSpec:
    """Validate the user's settings against this host. Raises a UserError on any problem."""
    count = _check_count("gpus", gpus)
    accel: AcceleratorType | None = None
    wanted_type: GPUType | None = None
    if gpu_type is not None:
        if isinstance(gpu_type, str) and gpu_type.strip().lower().startswith("gpu_") \
                or isinstance(gpu_type, AcceleratorType):
            accel = AcceleratorType.parse(gpu_type)
            wanted_type = accel.gpu_type
        else:
            wanted_type = GPUType.parse(gpu_type)
    if count is None and accel is not None:
        count = accel.gpus_per_node
    if not isinstance(remote, bool):
        raise ConfigurationError(f"remote must be True or False, got {remote!r}.")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, numbers.Integral) \
            or max_restarts < 0:
        raise ConfigurationError(f"max_restarts must be an int >= 0, got {max_restarts!r}.")
    timeout_s = _check_seconds("timeout", timeout)
    hang_s = _check_seconds("hang_timeout", hang_timeout)
    grace = _check_seconds("shutdown_grace", shutdown_grace, allow_none=False)
    logs = normalize_stream_logs(stream_logs)
    env_items: tuple[tuple[str, str], ...] = ()
    if env:
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                for k, v in env.items()):
            raise ConfigurationError("env must be a dict of str -> str (environment variables "
                                     "for the workers).")
        env_items = tuple(sorted(env.items()))

    common = dict(timeout=timeout_s, hang_timeout=hang_s, max_restarts=int(max_restarts),
                  shutdown_grace=grace, stream_logs=logs, remote=remote, env=env_items)

    if remote:
        # Placement happens on the cluster; the cluster backend checks counts and types there.
        if count is None:
            raise GPUValidationError("remote=True needs an explicit gpus= (total GPUs across "
                                     "the cluster), e.g. @distributed(gpus=16, remote=True).")
        return LaunchSpec(nproc_per_node=count, device="cuda", gpu_type=wanted_type,
                          nnodes=nnodes, **common)

    if host.has_gpu:
        available = len(host.gpus)
        have_types = {g.gpu_type for g in host.gpus}
        if wanted_type is not None and wanted_type not in have_types:
            raise GPUTypeError(
                f"gpu_type={wanted_type.name} was requested, but this host has "
                f"{host.describe()}. Drop gpu_type (or pass the type this host has), or use "
                "remote=True to run on a cluster that has that GPU.")
        if count is None:
            count = available
        if count > available:
            raise GPUValidationError(
                f"gpus={count} was requested, but this host has {available} GPU(s): "
                f"{host.describe()}. Use gpus<={available} (or gpus=None for all of them), or "
                "remote=True to run on a cluster.")
        resolved_type = wanted_type or next(iter(t for t in have_types if t), None)
        return LaunchSpec(nproc_per_node=count, device="cuda", gpu_type=resolved_type, **common)

    # No GPU: CPU worker processes with gloo, a first-class mode (laptops, CI).
    if wanted_type is not None:
        raise GPUTypeError(
            f"gpu_type={wanted_type.name} was requested, but this host has {host.describe()}. "
            "Drop gpu_type to run on CPU worker processes here, or use remote=True.")
    limit = max_cpu_workers(host.cpu_count)
    if count is None:
        count = int(os.environ.get("GPULAUNCH_CPU_WORKERS", DEFAULT_CPU_WORKERS))
    if count > limit:
        raise GPUValidationError(
            f"gpus={count} was requested, but this host has no GPU; gpulaunch runs up to {limit} "
            f"CPU worker processes here ({host.cpu_count} cores). Use gpus<={limit}, set "
            "GPULAUNCH_MAX_CPU_WORKERS to allow more, or run on a GPU host.")
    return LaunchSpec(nproc_per_node=count, device="cpu", gpu_type=None, **common)
