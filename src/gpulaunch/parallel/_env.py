"""Small facts about the current process: rank, world, device, and the package's error type."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

try:  # the core package's user-error base, once merged
    from gpulaunch.errors import ConfigurationError as _Base  # type: ignore
except Exception:  # pragma: no cover - standalone use
    _Base = ValueError

log = logging.getLogger("gpulaunch.parallel")


class ParallelError(_Base):
    """A mistake in how ``gpulaunch.parallel`` was called; the message says how to fix it."""


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    if is_dist():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def world_size() -> int:
    if is_dist():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def barrier() -> None:
    if is_dist():
        dist.barrier()


def default_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` when CUDA is there (or the current device), else CPU."""
    if torch.cuda.is_available():
        if is_dist() and dist.get_backend() == "gloo":
            return torch.device("cpu")
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def is_url(path) -> bool:
    return "://" in str(path)


def require_process_group(strategy: str) -> None:
    if not is_dist():
        raise ParallelError(
            f"strategy={strategy!r} needs a process group, and none is initialised. Call "
            "`gpulaunch.runtime.init()` inside your @distributed function (or "
            "`torch.distributed.init_process_group(...)`) before prepare(); "
            "use strategy='none' for plain single-process training.")
