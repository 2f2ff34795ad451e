"""Where the data helpers used to live; they are in :mod:`gpulaunch.data` now. This module keeps
``from gpulaunch.parallel.data import ...`` (and ``gpulaunch.parallel``'s names) working."""

from gpulaunch.data.files import ShardedFileDataset, read_lines
from gpulaunch.data.mapstyle import (
    DistributedLoader,
    distributed_loader,
    seed_everything,
    to_device,
)

__all__ = ["DistributedLoader", "ShardedFileDataset", "distributed_loader", "read_lines",
           "seed_everything", "to_device"]
