"""The sharding plan (gpulaunch.data.plan): pure functions, milliseconds, no processes."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from gpulaunch.data.plan import Assignment, EpochOrder, count, merge

pytestmark = pytest.mark.unit


def test_order_is_a_permutation_and_deterministic():
    lens = [5, 7, 1, 30, 12, 9]
    a = EpochOrder(lens, seed=3, epoch=1, shuffle_rows=10)
    b = EpochOrder(lens, seed=3, epoch=1, shuffle_rows=10)
    blocks, rows = a.rows(0, a.num_rows)
    ids = set(zip(blocks.tolist(), rows.tolist()))
    assert len(ids) == sum(lens) == a.num_rows
    assert all(0 <= r < lens[bk] for bk, r in ids)
    assert np.array_equal(blocks, b.rows(0, b.num_rows)[0])
    # random access agrees with one pass
    for lo, hi in [(0, 3), (4, 40), (17, 64)]:
        assert np.array_equal(a.rows(lo, hi)[1], rows[lo:hi])
    other = EpochOrder(lens, seed=3, epoch=2, shuffle_rows=10).rows(0, a.num_rows)
    assert not np.array_equal(other[1], rows) or not np.array_equal(other[0], blocks)
    plain = EpochOrder(lens, shuffle=False).rows(0, a.num_rows)
    assert plain[0].tolist() == [i for i, n in enumerate(lens) for _ in range(n)]


def test_shuffle_stays_inside_windows():
    lens = [10] * 20
    o = EpochOrder(lens, seed=1, shuffle_rows=30)
    assert o.max_window_blocks == 3
    blocks, _ = o.rows(0, 30)
    assert len(set(blocks.tolist())) == 3      # the first 30 positions: one window of 3 blocks


@pytest.mark.parametrize("n,world,workers,batch", [
    (100, 2, 2, 8), (101, 2, 2, 8), (7, 3, 1, 4), (64, 4, 3, 4), (9, 2, 4, 1), (3, 4, 1, 2)])
def test_assignment_covers_each_position_once_with_equal_batches(n, world, workers, batch):
    a = Assignment([(0, n)], world, workers, batch)
    seen = Counter()
    per_rank = []
    for r in range(world):
        bs = list(a.batches(r))
        per_rank.append(len(bs))
        assert [b.index for b in bs] == list(range(len(bs)))
        assert [b.worker for b in bs] == [j % workers for j in range(len(bs))]
        assert all(1 <= len(b.positions) <= batch for b in bs)
        seen.update(p for b in bs for p in b.positions.tolist())
    assert len(set(per_rank)) == 1                          # equal batches per rank
    assert set(seen) == set(range(n))                       # nothing lost
    repeats = sum(c - 1 for c in seen.values())
    assert repeats <= world - 1 and (repeats == 0 or n % world != 0)
    dropped = Assignment([(0, n)], world, workers, batch, drop_last=True)
    d = [p for r in range(world) for b in dropped.batches(r) for p in b.positions.tolist()]
    assert len(d) == len(set(d)) and all(len(b.positions) == batch
                                          for r in range(world) for b in dropped.batches(r))


def test_one_worker_reads_contiguous_positions():
    a = Assignment([(0, 1000)], 2, 4, 10)
    for r, w in itertools.product(range(2), range(4)):
        pos = np.concatenate([b.positions for b in a.batches(r, worker=w)])
        assert np.array_equal(pos, np.arange(pos[0], pos[0] + len(pos)))


@pytest.mark.parametrize("world1,workers1,batch1,stop,world2,workers2,batch2", [
    (2, 2, 8, 3, 2, 2, 8),       # same shape
    (2, 2, 8, 3, 3, 1, 8),       # another world size and worker count
    (4, 3, 5, 2, 1, 2, 7),       # shrink to one rank, another batch size
    (1, 1, 4, 5, 4, 2, 3),       # grow
])
def test_resume_at_any_shape_sees_each_position_once(world1, workers1, batch1, stop, world2,
                                                     workers2, batch2):
    n = 203
    first = Assignment([(0, n)], world1, workers1, batch1)
    seen = Counter(p for r in range(world1) for b in first.batches(r) if b.index < stop
                   for p in b.positions.tolist())
    rest = first.remaining_after(stop)
    assert count(rest) == n - len(seen)
    second = Assignment(rest, world2, workers2, batch2)
    # a second interruption inside the resumed run
    seen2 = Counter(p for r in range(world2) for b in second.batches(r) if b.index < 2
                    for p in b.positions.tolist())
    third = Assignment(second.remaining_after(2), world1, workers1, batch1)
    seen3 = Counter(p for r in range(world1) for b in third.batches(r)
                    for p in b.positions.tolist())
    total = seen + seen2 + seen3
    assert set(total) == set(range(n))
    extra = sum(c - 1 for c in total.values())
    assert extra <= world1 - 1      # only the final epoch-end pad repeats a row (203 is odd)


def test_uninterrupted_equals_resumed_same_shape():
    full = Assignment([(0, 150)], 2, 2, 8)
    order = {r: [b.positions.tolist() for b in full.batches(r)] for r in range(2)}
    resumed = Assignment(full.remaining_after(4), 2, 2, 8)
    for r in range(2):
        assert [b.positions.tolist() for b in resumed.batches(r)] == order[r][4:]


def test_end_of_epoch_and_merge():
    a = Assignment([(0, 10)], 2, 1, 5)
    assert a.remaining_after(a.num_batches) == []
    assert merge([(5, 7), (0, 2), (2, 3), (9, 9)]) == [(0, 3), (5, 7)]
    assert Assignment([], 2, 2, 4).num_batches == 0
