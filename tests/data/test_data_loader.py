"""StreamingLoader in one process: its state_dict resumes exactly, at another world size, worker
count or batch size too; the Checkpointable registry; batches on a device."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from data_fixtures import write_parquet

from gpulaunch.data import Checkpointable, StreamingDataset, StreamingLoader, register, unregister
from gpulaunch.data import state as registry
from gpulaunch.errors import DataError


def _loaders(ds, world, workers, batch):
    return [StreamingLoader(ds, batch, num_workers=workers, rank=r, world_size=world, name=None)
            for r in range(world)]


def _step(loaders, its):
    """One training step: every rank takes one batch."""
    return [next(it)["id"].tolist() for it in its]


@pytest.mark.parametrize("second", [(2, 2, 4), (3, 1, 4), (1, 0, 7)])
def test_killed_mid_epoch_resumes_each_row_once(tmp_path, second):
    ds = StreamingDataset(write_parquet(tmp_path / "p", 101, row_group=9), seed=2, shuffle_rows=20)
    first = _loaders(ds, 2, 2, 4)
    for ld in first:
        ld.set_epoch(1)
    its = [iter(ld) for ld in first]
    seen = Counter()
    for _ in range(5):
        for ids in _step(first, its):
            seen.update(ids)
    state = first[0].state_dict()
    assert state == first[1].state_dict()              # every rank computes the same state
    assert state["epoch"] == 1 and sum(b - a for a, b in state["remaining"]) == 101 - 40
    world, workers, batch = second
    again = _loaders(ds, world, workers, batch)
    for ld in again:
        ld.load_state_dict(state)
    assert {ld.epoch for ld in again} == {1}
    lengths = {len(ld) for ld in again}
    assert len(lengths) == 1                          # equal batches on every rank
    for ld in again:
        seen.update(i for b in ld for i in b["id"].tolist())
    extra = sum(c - 1 for c in seen.values())
    assert set(seen) == set(range(101)) and extra <= world - 1
    nxt = again[0].state_dict()
    assert nxt["epoch"] == 2 and nxt["remaining"] is None


def test_same_shape_resume_gives_the_uninterrupted_batches(tmp_path):
    ds = StreamingDataset(write_parquet(tmp_path / "p", 80, row_group=6), seed=7, shuffle_rows=12)
    whole = [b["id"].tolist() for b in StreamingLoader(ds, 4, num_workers=2, rank=1,
                                                       world_size=2, name=None)]
    part = StreamingLoader(ds, 4, num_workers=2, rank=1, world_size=2, name=None)
    it = iter(part)
    head = [next(it)["id"].tolist() for _ in range(3)]
    rest = StreamingLoader(ds, 4, num_workers=2, rank=1, world_size=2, name=None)
    rest.load_state_dict(part.state_dict())
    assert head + [b["id"].tolist() for b in rest] == whole


def test_epochs_loop_and_restart_from_state(tmp_path):
    ds = StreamingDataset(write_parquet(tmp_path / "p", 30), seed=1)
    ld = StreamingLoader(ds, 4, rank=0, world_size=1, name=None)
    counts = {}
    for epoch in ld.epochs(3):
        counts[epoch] = sum(len(b["id"]) for b in ld)
    assert counts == {0: 30, 1: 30, 2: 30} and ld.state_dict()["epoch"] == 3
    ld2 = StreamingLoader(ds, 4, rank=0, world_size=1, name=None)
    it = iter(ld2)
    next(it)
    ld3 = StreamingLoader(ds, 4, rank=0, world_size=1, name=None)
    ld3.load_state_dict(ld2.state_dict())
    got = []
    for epoch in ld3.epochs(1):
        got += [i for b in ld3 for i in b["id"].tolist()]
    assert len(got) == 26


def test_state_refuses_other_data(tmp_path):
    a = StreamingDataset(write_parquet(tmp_path / "a", 30), seed=1)
    b = StreamingDataset(write_parquet(tmp_path / "b", 31), seed=1)
    st = StreamingLoader(a, 4, rank=0, world_size=1, name=None).state_dict()
    with pytest.raises(DataError, match="30 rows.*31"):
        StreamingLoader(b, 4, rank=0, world_size=1, name=None).load_state_dict(st)
    with pytest.raises(DataError, match="seed=1"):
        StreamingLoader(StreamingDataset(str(tmp_path / "a"), seed=2), 4, rank=0, world_size=1,
                        name=None).load_state_dict(st)


def test_registry_carries_states_both_ways(tmp_path):
    ds = StreamingDataset(write_parquet(tmp_path / "p", 30), seed=1)
    ld = StreamingLoader(ds, 4, rank=0, world_size=1)            # registered as "train"
    try:
        it = iter(ld)
        next(it)
        saved = registry.checkpoint_state()
        assert saved["train"]["remaining"] == ld.state_dict()["remaining"]
        with pytest.raises(DataError, match="name='val'"):
            StreamingLoader(ds, 4, rank=0, world_size=1)
        del it, ld
        registry.restore(saved)                  # no loader yet: waits for one
        again = StreamingLoader(ds, 4, rank=0, world_size=1)
        assert again.state_dict()["remaining"] == saved["train"]["remaining"]

        class Counter_:
            def __init__(self):
                self.n = 0

            def state_dict(self):
                return {"n": self.n}

            def load_state_dict(self, st):
                self.n = st["n"]
        c = Counter_()
        assert isinstance(c, Checkpointable)
        register(c, "counter")
        c.n = 5
        assert registry.checkpoint_state()["counter"] == {"n": 5}
        registry.restore({"counter": {"n": 2}})
        assert c.n == 2
        with pytest.raises(DataError, match="Checkpointable"):
            register(object(), "x")
    finally:
        unregister("train")
        unregister("counter")


def test_device_batches_are_moved(tmp_path):
    ds = StreamingDataset(write_parquet(tmp_path / "p", 12), shuffle=False)
    ld = StreamingLoader(ds, 4, rank=0, world_size=1, device="cpu", name=None)
    b = next(iter(ld))
    assert b["id"].device == torch.device("cpu") and b["tokens"].dtype == torch.int32
