"""Which rows each rank and loader worker reads, in which order: pure functions, no I/O.

An epoch is a sequence of *positions* 0..N-1, each naming one row of the dataset
(:class:`EpochOrder`). Storage is a list of *blocks* (a Parquet row group, one JSONL file, ...),
each a run of rows. With ``shuffle`` the epoch permutes the blocks (seed, epoch), groups the
permuted blocks into windows of at least ``shuffle_rows`` rows and permutes the rows inside each
window: a reader walking a contiguous run of positions touches only a window's blocks at a time,
yet the order is random at row level within that window.

What is left of an epoch is a list of position ranges (``remaining``). :class:`Assignment`
splits it over ``world_size`` ranks x ``num_workers`` streams for a per-rank ``batch_size``:

* rank r gets a contiguous share of the remaining sequence (shares differ by at most one row);
* every rank gets the same number of batches (no rank stalls a collective at the epoch's end):
  all batches full except each rank's last; a rank whose share is one row short of the others'
  repeats its first row there (at most one repeated row per rank, only when the rows do not
  divide evenly; ``drop_last=True`` instead drops the tail so every batch is full);
* a rank's share is cut into ``num_workers`` contiguous regions; batch j comes from region
  j % num_workers, as torch's DataLoader asks its workers round robin. Each worker therefore reads
  a contiguous run of positions: every block is read by about one worker.

After c batches (the same c on every rank: they step together) :meth:`Assignment.remaining_after`
gives the positions nobody has seen yet. That list is the loader's checkpoint; a restart, at any
world size, worker count or batch size, assigns exactly those positions again, so each row of the
epoch is seen exactly once.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

Ranges = list[tuple[int, int]]


def _rng(*key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64([int(k) & (2 ** 63 - 1) for k in key]))


def merge(ranges) -> Ranges:
    """Sorted, non-empty, non-overlapping ranges covering the same positions."""
    out: Ranges = []
    for a, b in sorted((int(a), int(b)) for a, b in ranges if b > a):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def count(ranges) -> int:
    return sum(b - a for a, b in ranges)


class EpochOrder:
    """The epoch's row order over blocks of ``block_rows`` rows each: ``rows(a, b)`` says which
    (block, row in block) positions a..b-1 are. Same inputs, same order, on every process."""

    def __init__(self, block_rows, *, seed: int = 0, epoch: int = 0, shuffle: bool = True,
                 shuffle_rows: int = 65536):
        self.block_rows = np.asarray(block_rows, dtype=np.int64)
        self.num_rows = int(self.block_rows.sum())
        self.seed, self.epoch, self.shuffle = int(seed), int(epoch), bool(shuffle)
        n = len(self.block_rows)
        self.blocks = _rng(self.seed, self.epoch, 1).permutation(n) if shuffle else np.arange(n)
        sizes = self.block_rows[self.blocks]
        # windows: consecutive permuted blocks, each window at least shuffle_rows rows
        bounds, acc = [0], 0
        for i, s in enumerate(sizes):
            acc += int(s)
            if acc >= max(1, shuffle_rows) and i + 1 < n:
                bounds.append(i + 1)
                acc = 0
        bounds.append(n)
        self._win_blocks = [self.blocks[bounds[i]:bounds[i + 1]] for i in range(len(bounds) - 1)]
        self._win_start = np.concatenate(
            [[0], np.cumsum([int(self.block_rows[w].sum()) for w in self._win_blocks])])
        self._window = lru_cache(maxsize=8)(self._window_uncached)

    @property
    def max_window_blocks(self) -> int:
        return max((len(w) for w in self._win_blocks), default=0)

    def _window_uncached(self, w: int):
        blocks = self._win_blocks[w]
        lens = self.block_rows[blocks]
        block_of = np.repeat(blocks, lens)
        row_of = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
        if self.shuffle:
            p = _rng(self.seed, self.epoch, 2, w).permutation(len(block_of))
            block_of, row_of = block_of[p], row_of[p]
        return block_of, row_of

    def rows(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(block ids, row within block) of positions a..b-1."""
        if not 0 <= a <= b <= self.num_rows:
            raise IndexError(f"positions {a}..{b} outside 0..{self.num_rows}")
        blocks, rows = [], []
        w = int(np.searchsorted(self._win_start, a, side="right")) - 1
        while a < b:
            start, end = int(self._win_start[w]), int(self._win_start[w + 1])
            hi = min(b, end)
            bo, ro = self._window(w)
            blocks.append(bo[a - start:hi - start])
            rows.append(ro[a - start:hi - start])
            a, w = hi, w + 1
        if not blocks:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        return np.concatenate(blocks), np.concatenate(rows)


@dataclass(frozen=True)
class Batch:
    """One batch of one rank: the epoch positions it holds, in order."""
    index: int
    worker: int
    positions: np.ndarray


@dataclass
class Assignment:
    """The rest of an epoch split over ``world_size`` ranks x ``num_workers`` streams."""

    remaining: Ranges
    world_size: int
    num_workers: int
    batch_size: int
    drop_last: bool = False
    _starts: list[int] = field(init=False, repr=False)

    def __post_init__(self):
        if self.world_size < 1 or self.batch_size < 1:
            raise ValueError(f"world_size and batch_size must be >= 1, got {self.world_size}, "
                             f"{self.batch_size}")
        self.remaining = merge(self.remaining)
        self.num_workers = max(1, int(self.num_workers))
        self._starts = [0]
        for a, b in self.remaining:
            self._starts.append(self._starts[-1] + b - a)

    @property
    def total(self) -> int:
        return self._starts[-1]

    def share(self, rank: int) -> tuple[int, int]:
        """Rank's slice [s, e) of the remaining sequence."""
        q, r = divmod(self.total, self.world_size)
        s = rank * q + min(rank, r)
        return s, s + q + (1 if rank < r else 0)

    @property
    def num_batches(self) -> int:
        """Batches every rank gets for the rest of the epoch."""
        if self.drop_last:
            return (self.total // self.world_size) // self.batch_size
        most = -(-self.total // self.world_size)
        return -(-most // self.batch_size)

    def _sizes(self, rank: int) -> list[int]:
        nb, b = self.num_batches, self.batch_size
        s, e = self.share(rank)
        if self.drop_last or nb == 0:
            return [b] * nb
        return [b] * (nb - 1) + [(e - s) - (nb - 1) * b]     # the last may be 0: padded later

    def _regions(self, rank: int) -> list[tuple[int, list[int]]]:
        """Per worker: (region start in the rank's share, sizes of its batches in order)."""
        sizes = self._sizes(rank)
        out, off = [], 0
        for w in range(self.num_workers):
            mine = sizes[w::self.num_workers]
            out.append((off, mine))
            off += sum(mine)
        return out

    def _to_ranges(self, a: int, b: int) -> Ranges:
        """Position ranges of remaining-sequence indices a..b-1."""
        out: Ranges = []
        i = bisect.bisect_right(self._starts, a) - 1
        while a < b:
            lo = self.remaining[i][0]
            seg_end = min(b, self._starts[i + 1])
            out.append((lo + a - self._starts[i], lo + seg_end - self._starts[i]))
            a, i = seg_end, i + 1
        return out

    def _to_positions(self, a: int, b: int) -> np.ndarray:
        parts = [np.arange(lo, hi, dtype=np.int64) for lo, hi in self._to_ranges(a, b)]
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def batches(self, rank: int, worker: int | None = None, skip: int = 0):
        """The rank's batches in the order the training loop sees them (or one worker's),
        after the first ``skip``. A pass that skips asks its workers round robin from worker
        0 again, so worker w then builds batches j with (j - skip) % num_workers == w."""
        s, _ = self.share(rank)
        regions = self._regions(rank)
        nb = self.num_batches
        for j in range(skip, nb):
            w = j % self.num_workers
            if worker is not None and (j - skip) % self.num_workers != worker:
                continue
            start, sizes = regions[w]
            i = j // self.num_workers
            lo = s + start + self.batch_size * i
            pos = self._to_positions(lo, lo + sizes[i])
            if len(pos) == 0:          # this rank is one row short: repeat a row
                k = min(s, self.total - 1)
                pos = self._to_positions(k, k + 1)
            yield Batch(j, w, pos)

    def remaining_after(self, consumed: int) -> Ranges:
        """Positions no rank has seen after every rank took ``consumed`` batches."""
        if consumed >= self.num_batches:
            return []
        out: Ranges = []
        for r in range(self.world_size):
            s, _ = self.share(r)
            for w, (start, sizes) in enumerate(self._regions(r)):
                done = len(range(w, consumed, self.num_workers))
                lo = s + start + sum(sizes[:done])
                hi = s + start + sum(sizes)
                out.extend(self._to_ranges(lo, hi))
        return merge(out)
