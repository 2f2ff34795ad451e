"""``ShardedFileDataset``: many files split over ranks x loader workers, whole files per stream.

It splits a list of files (local paths, globs or fsspec URLs) into ``world_size * num_workers``
disjoint streams: rank r's worker w reads files ``order[r * W + w :: R * W]``. Every rank must
use the same ``num_workers``; ``distributed_loader`` checks that with a collective. Row-level
sharding and exact resume at another world size are :class:`gpulaunch.data.StreamingDataset`'s.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from gpulaunch import runtime as rt
from gpulaunch.errors import DataError

from ._fs import is_url

__all__ = ["ShardedFileDataset", "read_lines"]


def read_lines(f) -> Iterator[str]:
    """Default reader: one sample per text line (UTF-8, newline stripped)."""
    for line in f:
        yield line.decode("utf-8").rstrip("\n") if isinstance(line, bytes) else line.rstrip("\n")


def _expand(files: str | Sequence[str]) -> list[str]:
    if isinstance(files, str):
        files = [files]
    out: list[str] = []
    for f in files:
        f = str(f)
        if any(ch in f for ch in "*?["):
            import fsspec

            fs, _ = fsspec.core.url_to_fs(f)
            proto = f.split("://", 1)[0] + "://" if is_url(f) else ""
            out.extend(sorted(proto + m if proto and "://" not in m else m for m in fs.glob(f)))
        else:
            out.append(f)
    return out


class ShardedFileDataset(IterableDataset):
    """Stream samples from many files, split across ranks and DataLoader workers without overlap.

    Args:
        files: paths, fsspec URLs, or glob patterns (expanded once, sorted, so every rank agrees).
        read_fn: ``fn(binary_file) -> iterable of samples``; default: text lines.
        shuffle: shuffle the file order each epoch (same permutation on every rank, from seed+epoch).
        seed: base seed for that permutation.
        drop_last: if the file count is not a multiple of ``streams = world_size * num_workers``,
            drop the remainder (True) or pad by repeating files from the start (False, the default,
            as ``DistributedSampler`` does) so every stream gets the same number of files.
        rank, world_size: default to the process group's (or ``RANK``/``WORLD_SIZE``).
    """

    def __init__(self, files: str | Sequence[str], read_fn: Callable[[Any], Iterable[Any]] = read_lines,
                 *, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 rank: int | None = None, world_size: int | None = None):
        self.files = _expand(files)
        if not self.files:
            raise DataError(f"ShardedFileDataset got no files (from {files!r})")
        self.read_fn, self.shuffle, self.seed, self.drop_last = read_fn, shuffle, seed, drop_last
        self.rank = rt.get_global_rank() if rank is None else rank
        self.world_size = rt.get_world_size() if world_size is None else world_size
        self.epoch = 0
        self.num_workers_hint: int | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def files_for(self, rank: int, worker: int, num_workers: int, epoch: int | None = None) -> list[str]:
        """The files that ``(rank, worker)`` reads in ``epoch``: a pure function, handy for checks."""
        epoch = self.epoch if epoch is None else epoch
        order = list(self.files)
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        streams = self.world_size * max(1, num_workers)
        if len(order) < streams and self.drop_last:
            raise DataError(f"{len(order)} files cannot feed {streams} streams (world_size "
                                f"{self.world_size} x {max(1, num_workers)} workers) with drop_last=True")
        rem = len(order) % streams
        if rem:
            if self.drop_last:
                order = order[:len(order) - rem]
            else:
                pad = streams - rem
                order = order + (order * (pad // len(order) + 1))[:pad]
        return order[rank * max(1, num_workers) + worker::streams]

    def _open(self, path: str):
        if is_url(path):
            import fsspec

            return fsspec.open(path, "rb")
        return open(path, "rb")

    def __iter__(self):
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if self.num_workers_hint is not None and max(1, self.num_workers_hint) != num_workers:
            raise DataError("ShardedFileDataset was set up for "
                                f"{self.num_workers_hint} workers but runs in {num_workers}")
        for path in self.files_for(self.rank, worker, num_workers):
            with self._open(path) as f:
                yield from self.read_fn(f)
