"""Map-style datasets across ranks: ``distributed_loader`` and its resumable ``DistributedLoader``.

``distributed_loader`` gives each rank a disjoint slice of a map-style dataset
(``DistributedSampler``), reshuffles per epoch with ``loader.set_epoch(epoch)``, and seeds every
loader worker from (seed, epoch, rank, worker) so random augmentation differs across ranks and
workers but is reproducible. Streams of rows from tables and object stores are
:class:`gpulaunch.data.StreamingLoader`'s job.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
)

from gpulaunch import runtime as rt
from gpulaunch.errors import DataError

from .files import ShardedFileDataset

__all__ = ["DistributedLoader", "distributed_loader", "seed_everything", "to_device"]


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy (if present) and torch (all devices) alike on this process."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2 ** 32)
    except ImportError:
        pass


class _WorkerSeeder:
    """Picklable ``worker_init_fn``: a distinct, reproducible seed per (seed, epoch, rank, worker)."""

    def __init__(self, seed: int, rank: int, user_fn: Callable | None = None):
        self.seed, self.rank, self.user_fn, self.epoch = seed, rank, user_fn, 0

    def __call__(self, worker_id: int):
        s = (self.seed * 1_000_003 + self.epoch * 10_007 + self.rank * 101 + worker_id) % 2 ** 63
        seed_everything(s)
        if self.user_fn is not None:
            self.user_fn(worker_id)


def to_device(batch, device: torch.device, non_blocking: bool = True):
    """``batch`` (a tensor, or dicts / lists / tuples of them) on ``device``; from pinned memory to
    a GPU the copies are asynchronous, so the host goes on queueing the step meanwhile."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return type(batch)((k, to_device(v, device, non_blocking)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):   # namedtuple
        return type(batch)(*(to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    return batch


class _ResumableSampler(DistributedSampler):
    """``DistributedSampler`` that can start an epoch after its first ``skip`` indices (a resumed
    run continues where it stopped without loading the samples it had already seen)."""

    skip = 0                  # one-shot: the next pass only

    def __iter__(self):
        skip, self.skip = self.skip, 0
        it = super().__iter__()
        return iter(list(it)[skip:]) if skip else it

    def __len__(self) -> int:
        return super().__len__() - self.skip


class DistributedLoader(DataLoader):
    """A ``DataLoader`` whose ``set_epoch(epoch)`` reaches its sampler, its dataset and its worker
    seeds, and which, given a ``device``, hands out batches already on it.

    ``state_dict()`` is its data position: the epoch and the batches handed out in it;
    ``load_state_dict()`` makes the next pass over that epoch start after them (map-style
    datasets: the sampler skips those indices; iterable ones: the batches are read and dropped),
    so a resumed run sees exactly the batches an uninterrupted one would have
    (``save_checkpoint(..., loader=)`` / ``resume(..., loader=)``)."""

    _gl_device: torch.device | None = None
    _gl_epoch = 0
    _gl_consumed = 0
    _gl_skip = 0              # batches to leave out of the next pass (a restored position)

    def __iter__(self):
        skip, self._gl_skip = self._gl_skip, 0
        drop = 0
        if isinstance(self.sampler, _ResumableSampler):
            self.sampler.skip = skip * self.batch_size if skip else 0
        elif skip:
            drop = skip           # an iterable dataset: read those batches and drop them
        return self._counted(super().__iter__(), skip, drop)

    def _counted(self, it, skip: int, drop: int):
        self._gl_consumed = skip
        for i, b in enumerate(it):
            if i < drop:
                continue
            self._gl_consumed += 1
            yield b if self._gl_device is None else \
                to_device(b, self._gl_device, non_blocking=self.pin_memory)

    def state_dict(self) -> dict:
        return {"epoch": self._gl_epoch, "batches": self._gl_consumed}

    def load_state_dict(self, state: dict) -> None:
        self.set_epoch(int(state["epoch"]))
        self._gl_consumed = self._gl_skip = int(state["batches"])

    def set_epoch(self, epoch: int) -> None:
        if epoch != self._gl_epoch:
            self._gl_skip = 0     # a restored position belongs to its own epoch only
        self._gl_epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        if isinstance(self.worker_init_fn, _WorkerSeeder):
            self.worker_init_fn.epoch = epoch
        if self.generator is not None:
            self.generator.manual_seed(self._gl_seed + epoch)


def distributed_loader(dataset: Dataset, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                       drop_last: bool = False, num_workers: int = 0,
                       rank: int | None = None, world_size: int | None = None,
                       device: torch.device | str | None = None, pin_memory: bool | None = None,
                       **loader_kwargs) -> DistributedLoader:
    """A ``DataLoader`` for this rank: ``batch_size`` is per rank (global batch = batch_size * world).

    Map-style datasets get a ``DistributedSampler`` (shuffled with ``seed + epoch``, same order
    on all ranks, disjoint slices). Iterable datasets must shard themselves (see
    :class:`ShardedFileDataset`). Call ``loader.set_epoch(epoch)`` at the start of each epoch.

    ``device``: hand out batches on this device (``"auto"``: this rank's, as
    :func:`gpulaunch.runtime.device` says), copied without blocking the host. ``pin_memory``:
    default on when batches go to a GPU (or, without ``device``, when this rank has one), so those
    copies are asynchronous DMA instead of a staged, synchronous copy.
    """
    if "sampler" in loader_kwargs:
        raise DataError("distributed_loader builds its own DistributedSampler; use a plain DataLoader "
                            "if you need a custom sampler")
    rank = rt.get_global_rank() if rank is None else rank
    world_size = rt.get_world_size() if world_size is None else world_size
    if isinstance(dataset, IterableDataset):
        sampler = None
        if isinstance(dataset, ShardedFileDataset):
            _check_same_num_workers(num_workers)
            dataset.num_workers_hint = num_workers
        if shuffle and not isinstance(dataset, ShardedFileDataset):
            warnings.warn("shuffle=True is ignored for an IterableDataset: it must shuffle itself", stacklevel=2)
        shuffle = False
    else:
        sampler = _ResumableSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle,
                                    seed=seed, drop_last=drop_last)
    if device == "auto":
        device = _default_device()
    device = torch.device(device) if device is not None else None
    if pin_memory is None:
        target = device if device is not None else _default_device()
        pin_memory = target.type == "cuda"
    gen = torch.Generator()
    gen.manual_seed(seed)
    loader = DistributedLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
                               num_workers=num_workers, generator=gen,
                               worker_init_fn=_WorkerSeeder(seed, rank, loader_kwargs.pop("worker_init_fn", None)),
                               persistent_workers=False, pin_memory=pin_memory, **loader_kwargs)
    loader._gl_seed = seed
    loader._gl_device = device
    return loader


def _check_same_num_workers(num_workers: int) -> None:
    if not _is_dist():
        return
    got: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, int(num_workers))
    if len(set(got)) > 1:
        raise DataError(f"every rank must use the same num_workers with a ShardedFileDataset "
                            f"(streams are world_size * num_workers); got {got} across ranks")




def _is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _default_device() -> torch.device:
    """This rank's device; CPU when the process group is gloo-only (its collectives would copy
    every CUDA tensor through the host)."""
    dev = rt.device()
    if dev.type == "cuda" and _is_dist() and dist.get_backend() == "gloo":
        return torch.device("cpu")
    return dev
