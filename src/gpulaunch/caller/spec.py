"""``resolve()``: the user's settings plus what the host has -> a ``LaunchSpec``, or a
``UserError`` that says what is wrong and what to do. Pure: nothing here starts a process.

Value checks already ran in ``LaunchOptions``; what is left needs the host: how many GPUs,
which type, how many CPU workers are sensible.
"""

from __future__ import annotations

import dataclasses
import os

from ..common import constants
from ..common.records import LaunchSpec
from ..errors import GPUTypeError, GPUValidationError
from ..hardware.catalog import AcceleratorType, GPUType
from ..hardware.host import HostInfo, max_cpu_workers
from ..options import LaunchOptions, field_names


def _wanted(options: LaunchOptions) -> tuple[int | None, GPUType | None]:
    count, t = options.gpus, options.gpu_type
    if isinstance(t, AcceleratorType):
        return (count if count is not None else t.gpus_per_node), t.gpu_type
    return count, t


def resolve(options: LaunchOptions, host: HostInfo) -> LaunchSpec:
    """Validate the settings against this host. Raises a UserError on any problem."""
    count, wanted_type = _wanted(options)
    env = dict(options.env)
    env.update(options.rank_env())
    # Every setting the spec shares with the options travels by name (a new LaunchOptions
    # field that the backends need is one more LaunchSpec field, nothing else); the GPU type
    # and the environment are resolved here.
    shared = {f.name for f in dataclasses.fields(LaunchSpec)} & field_names()
    common = {name: getattr(options, name) for name in shared - {"gpu_type", "env"}}
    common["env"] = tuple(sorted(env.items()))

    if options.remote:
        # Placement happens on the cluster; the Ray backend checks counts and types there.
        if count is None:
            raise GPUValidationError("remote=True needs an explicit gpus= (total GPUs across "
                                     "the cluster), e.g. @distributed(gpus=16, remote=True).")
        return LaunchSpec(nproc_per_node=count, device="cuda", gpu_type=wanted_type, **common)

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
        resolved = wanted_type or next(iter(t for t in have_types if t), None)
        return LaunchSpec(nproc_per_node=count, device="cuda", gpu_type=resolved, **common)

    # No GPU: CPU worker processes with gloo, a first-class mode (laptops, CI).
    if wanted_type is not None:
        raise GPUTypeError(
            f"gpu_type={wanted_type.name} was requested, but this host has {host.describe()}. "
            "Drop gpu_type to run on CPU worker processes here, or use remote=True.")
    limit = max_cpu_workers(host.cpu_count)
    if count is None:
        count = int(os.environ.get("GPULAUNCH_CPU_WORKERS", constants.DEFAULT_CPU_WORKERS))
    if count > limit:
        raise GPUValidationError(
            f"gpus={count} was requested, but this host has no GPU; gpulaunch runs up to {limit} "
            f"CPU worker processes here ({host.cpu_count} cores). Use gpus<={limit}, set "
            "GPULAUNCH_MAX_CPU_WORKERS to allow more, or run on a GPU host.")
    return LaunchSpec(nproc_per_node=count, device="cpu", gpu_type=None, **common)
