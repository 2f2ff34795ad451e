"""A :class:`StreamingDataset` as one endless stream of rows: epoch 0's order, then epoch 1's...

Position ``p`` of the stream is position ``p % N`` of epoch ``p // N``'s order (:mod:`.plan`,
``EpochOrder``: the same seeded shuffle as :class:`StreamingLoader`'s). Any run of positions
``[a, b)`` can be read, across an epoch's end too, by any process, without knowing who read the
positions before it: a run is named by two integers. That is what a loader whose readers come
and go needs (``gpulaunch.ft``'s elastic loader: one shared position, re-cut over the live
replica groups at every step); :class:`StreamingLoader` itself splits an epoch into per-rank
shares instead, which suits a fixed world size.

    reader = StreamReader(dataset)
    batch = reader.read(0, 32)          # rows at stream positions 0..31, collated as a batch
    reader.prefetch(32, 64)             # start reading the blocks of the next run
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .dataset import StreamingDataset, _BlockReader
from .plan import EpochOrder


def epoch_spans(a: int, b: int, num_rows: int) -> list[tuple[int, int, int]]:
    """Stream positions ``[a, b)`` as ``(epoch, start, end)`` runs within epochs."""
    if num_rows < 1 or a < 0 or b < a:
        raise ValueError(f"positions {a}..{b} of a stream of {num_rows}-row epochs")
    out = []
    while a < b:
        epoch, start = divmod(a, num_rows)
        end = min(num_rows, start + (b - a))
        out.append((epoch, start, end))
        a += end - start
    return out


class StreamReader:
    """Reads runs of stream positions of ``dataset`` as batches (the dataset's collation:
    columns as tensors, or ``transform`` / ``collate``), keeping recent blocks in memory."""

    def __init__(self, dataset: StreamingDataset):
        self.dataset = dataset
        self._order = lru_cache(maxsize=3)(dataset.order)
        window = self._order(0).max_window_blocks
        self._reader = _BlockReader(dataset.source, keep=2 * window + 4,
                                    threads=dataset.read_threads)

    def where(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(block ids, rows within block) of stream positions ``[a, b)``, in stream order."""
        parts = [self._order(e).rows(lo, hi)
                 for e, lo, hi in epoch_spans(a, b, self.dataset.num_rows)]
        if not parts:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def order(self, epoch: int) -> EpochOrder:
        return self._order(epoch)

    def prefetch(self, a: int, b: int) -> None:
        """Start reading the blocks of positions ``[a, b)`` in the background."""
        if b > a:
            self._reader.prefetch(np.unique(self.where(a, b)[0]))

    def read(self, a: int, b: int):
        """The rows at stream positions ``[a, b)`` as one batch."""
        if b <= a:
            raise ValueError(f"an empty run of positions {a}..{b}")
        return self.dataset.collate_table(self._reader.take(*self.where(a, b)))

    def close(self) -> None:
        self._reader.close()
