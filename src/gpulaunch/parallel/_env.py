"""The package's error type and the few facts about this process it needs.

Rank, world size, local rank and the device come from :mod:`gpulaunch.runtime`, the launcher's
own answer (process group first, then the launcher's environment), so that ``prepare()`` and the
code around it never disagree about who this rank is or which GPU it owns.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from gpulaunch import runtime as rt
from gpulaunch.errors import ConfigurationError

log = logging.getLogger("gpulaunch.parallel")

rank = rt.get_global_rank
world_size = rt.get_world_size
local_rank = rt.get_local_rank


class ParallelError(ConfigurationError):
    """A mistake in how ``gpulaunch.parallel`` was called; the message says how to fix it."""


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    if is_dist():
        dist.barrier()


def default_device() -> torch.device:
    """This rank's device, as :func:`gpulaunch.runtime.device` says (``cuda:<local_rank>`` when
    that GPU exists, else CPU); CPU too when the process group is gloo-only, whose collectives
    would otherwise copy every CUDA tensor through the host."""
    dev = rt.device()
    if dev.type == "cuda" and is_dist() and dist.get_backend() == "gloo":
        return torch.device("cpu")
    return dev


def is_url(path) -> bool:
    return "://" in str(path)


def require_process_group(strategy: str) -> None:
    if not is_dist():
        raise ParallelError(
            f"strategy={strategy!r} needs a process group, and none is initialised. Call "
            "`gpulaunch.runtime.init()` inside your @distributed function (or "
            "`torch.distributed.init_process_group(...)`) before prepare(); "
            "use strategy='none' for plain single-process training.")
