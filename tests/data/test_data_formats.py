"""Every format read through StreamingDataset/StreamingLoader: all rows, once, in batches of
tensors; bad input gets a DataError naming the path and the problem."""

from __future__ import annotations

import pytest
import torch
from data_fixtures import (
    write_delta,
    write_hf_arrow,
    write_jsonl,
    write_parquet,
    write_text,
    write_webdataset,
)

from gpulaunch.data import StreamingDataset, StreamingLoader
from gpulaunch.errors import DataError

WRITERS = {"parquet": write_parquet, "delta": write_delta, "jsonl": write_jsonl,
           "text": write_text, "webdataset": write_webdataset, "arrow": write_hf_arrow}


def ids_of(batch) -> list[int]:
    for key in ("id", "cls", "text"):
        if key in batch:
            v = batch[key]
            return [int(x) for x in (v.tolist() if isinstance(v, torch.Tensor) else v)]
    raise AssertionError(batch.keys())


@pytest.mark.parametrize("fmt", sorted(WRITERS))
@pytest.mark.parametrize("workers", [0, 2])
def test_every_format_reads_every_row_once(tmp_path, fmt, workers):
    path = WRITERS[fmt](tmp_path / fmt, 37)
    ds = StreamingDataset(path, seed=4)
    assert ds.source.format == fmt and ds.num_rows == 37
    seen = []
    for rank in range(2):        # two ranks' loaders, built as each rank builds its own
        loader = StreamingLoader(ds, batch_size=5, num_workers=workers, rank=rank, world_size=2,
                                 name=None)
        batches = list(loader)
        assert len(batches) == 4                         # equal on both ranks: ceil(19 / 5)
        seen += [i for b in batches for i in ids_of(b)]
    assert sorted(set(seen)) == list(range(37))
    assert len(seen) == 37                               # shares of 19 and 18 rows: no repeat


def test_parquet_batches_are_tensors_and_columns_selected(tmp_path):
    path = write_parquet(tmp_path / "p", 20)
    ds = StreamingDataset(path, columns=["id", "tokens", "name"], shuffle=False)
    b = next(iter(StreamingLoader(ds, batch_size=4, rank=0, world_size=1, name=None)))
    assert set(b) == {"id", "tokens", "name"}
    assert b["id"].tolist() == [0, 1, 2, 3] and b["tokens"].shape == (4, 3)
    assert b["tokens"][1].tolist() == [1, 2, 3] and b["name"][0] == "row-0"
    t = StreamingDataset(path, transform=lambda r: torch.tensor([r["id"], len(r["name"])]),
                         shuffle=False)
    assert next(iter(StreamingLoader(t, 2, rank=0, world_size=1, name=None))).tolist() == \
        [[0, 5], [1, 5]]


def test_delta_pins_version_and_honours_deletion_vectors(tmp_path):
    path = write_delta(tmp_path / "t", 30, delete={4, 17})
    ds = StreamingDataset(path, format="delta")
    assert ds.num_rows == 28 and ds.version == 2
    seen = [i for b in StreamingLoader(ds, 8, rank=0, world_size=1, name=None) for i in ids_of(b)]
    assert sorted(seen) == [i for i in range(30) if i not in (4, 17)]
    old = StreamingDataset(path, version=1)               # before the delete
    assert old.num_rows == 30
    import pyarrow as pa
    from deltalake import write_deltalake
    write_deltalake(path, pa.table({"id": pa.array([99], pa.int64()),
                                    "x": pa.array([0.0], pa.float32())}), mode="append")
    assert ds.num_rows == 28 and StreamingDataset(path).num_rows == 29   # ds stays pinned


def test_shuffle_differs_per_epoch_and_is_the_same_for_the_same_seed(tmp_path):
    path = write_parquet(tmp_path / "p", 200, row_group=10)

    def epoch_ids(seed, epoch):
        ld = StreamingLoader(StreamingDataset(path, seed=seed, shuffle_rows=40), 200, rank=0,
                             world_size=1, name=None)
        ld.set_epoch(epoch)
        return ids_of(next(iter(ld)))
    assert epoch_ids(1, 0) == epoch_ids(1, 0)
    assert epoch_ids(1, 0) != epoch_ids(1, 1) and epoch_ids(1, 0) != epoch_ids(2, 0)
    assert sorted(epoch_ids(1, 1)) == list(range(200))


def test_bad_input_names_path_and_problem(tmp_path):
    with pytest.raises(DataError, match="nope.*not found"):
        StreamingDataset(str(tmp_path / "nope.parquet"))
    with pytest.raises(DataError, match="not a Delta table"):
        StreamingDataset(str(tmp_path), format="delta")
    path = write_parquet(tmp_path / "p", 10)
    with pytest.raises(DataError, match=r"no column 'label'.*\['id', 'x', 'tokens', 'name'\]"):
        StreamingDataset(path, columns=["id", "label"])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.parquet").write_bytes(b"this is not parquet at all")
    with pytest.raises(DataError, match=r"a\.parquet.*Parquet"):
        StreamingDataset(str(bad))
    with pytest.raises(DataError, match="cannot tell its format"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "x.bin").write_bytes(b"1")
        StreamingDataset(str(tmp_path / "empty"))
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "a.jsonl").write_text('{"id": 1}\n{"id": \n')
    with pytest.raises(DataError, match=r"a\.jsonl.*not JSON lines"):
        list(StreamingLoader(StreamingDataset(str(tmp_path / "j")), 2, rank=0, world_size=1,
                             name=None))


def test_a_shard_that_breaks_after_opening_fails_in_the_worker_with_its_name(tmp_path):
    path = write_jsonl(tmp_path / "j", 30)
    ds = StreamingDataset(path)
    (tmp_path / "j" / "part-1.jsonl").write_text("garbage\n" * 10)
    with pytest.raises(DataError, match="part-1.jsonl"):
        list(StreamingLoader(ds, 4, num_workers=2, rank=0, world_size=1, name=None))
