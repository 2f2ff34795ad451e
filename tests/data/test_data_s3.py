"""Data and checkpoints on a real S3-protocol server (moto's, on loopback, started here): rows
read by 2 ranks x 2 loader workers, staged checkpoint uploads and once-per-node downloads, and
the errors a store gives (credentials refused, missing bucket)."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from data_fixtures import write_delta, write_parquet
from s3_server import started

from gpulaunch import distributed
from gpulaunch import runtime as rt
from gpulaunch.errors import DataError


@pytest.fixture
def s3(monkeypatch, tmp_path):
    server = started(monkeypatch)
    monkeypatch.setenv("GPULAUNCH_STAGE_DIR", str(tmp_path / "stage"))
    import s3fs
    s3fs.S3FileSystem.clear_instance_cache()
    yield server
    server.stop()
    s3fs.S3FileSystem.clear_instance_cache()


def _read_all(urls: list[str], opts: dict):
    from gpulaunch.data import StreamingDataset, StreamingLoader

    rt.init()
    out = {}
    for url in urls:
        loader = StreamingLoader(StreamingDataset(url, storage_options=opts, seed=1), 4,
                                 num_workers=2, name=None)
        out[url] = {"ids": [i for b in loader for i in b["id"].tolist()]}
    return out


@pytest.mark.slow
def test_two_ranks_two_workers_read_each_row_once_from_s3(s3, tmp_path):
    bucket = s3.make_bucket("data")
    parquet = s3.upload(write_parquet(tmp_path / "p", 53, row_group=5), bucket + "/events")
    delta = s3.upload(write_delta(tmp_path / "t", 40, delete={7}), bucket + "/table")
    res = distributed(gpus=2)(_read_all).distributed([parquet, delta], s3.storage_options)
    for url, expected in ((parquet, range(53)), (delta, [i for i in range(40) if i != 7])):
        seen = Counter(res[0][url]["ids"]) + Counter(res[1][url]["ids"])
        assert set(seen) == set(expected)
        assert sum(seen.values()) - len(seen) <= 1          # an odd count: one row repeated
        assert len(res[0][url]["ids"]) >= len(res[1][url]["ids"])


def test_store_errors_name_the_url(s3, tmp_path):
    from gpulaunch.data import StreamingDataset

    bucket = s3.make_bucket("data")
    url = s3.upload(write_parquet(tmp_path / "p", 10), bucket + "/p")
    with pytest.raises(DataError, match="s3://data/p: credentials refused"):
        StreamingDataset(url, storage_options=dict(s3.storage_options, secret="wrong"))
    with pytest.raises(DataError, match="s3://missing-bucket/p: not found"):
        StreamingDataset("s3://missing-bucket/p", storage_options=s3.storage_options)
    with pytest.raises(DataError, match="s3://data/nothing: not a Delta table"):
        StreamingDataset("s3://data/nothing", format="delta", storage_options=s3.storage_options)


def _save_and_resume(root: str, phase: str):
    from gpulaunch.data import StreamingDataset, StreamingLoader
    from gpulaunch.parallel import prepare, resume, save_checkpoint, wait_for_checkpoint

    rt.init()
    torch.manual_seed(0)
    p = prepare(torch.nn.Linear(3, 1), lambda ps: torch.optim.SGD(ps, lr=0.1), strategy="ddp")
    ds = StreamingDataset(os.environ["TEST_TABLE"], seed=0)
    loader = StreamingLoader(ds, 2)
    step = resume(root, p)
    it = iter(loader)
    if phase == "save":
        for _ in range(3):
            b = next(it)
            loss = p.model(b["tokens"].float()).pow(2).mean()
            p.backward(loss)
            p.step()
            p.zero_grad()
            step += 1
        save_checkpoint(root, p, step=step)
        wait_for_checkpoint()
    rt.barrier()                    # every rank is past its load (and its copy's removal)
    stage = os.environ["GPULAUNCH_STAGE_DIR"]
    left = [n for n in os.listdir(os.path.join(stage, f"gpulaunch-stage-{os.getuid()}"))]
    return {"step": step, "weights": [t.detach().clone() for t in p.model.module.parameters()],
            "next": next(it)["id"].tolist(), "left": left}


@pytest.mark.slow
def test_staged_checkpoint_to_s3_round_trip(s3, tmp_path, monkeypatch):
    bucket = s3.make_bucket("ckpt")
    monkeypatch.setenv("TEST_TABLE", write_parquet(tmp_path / "p", 40))
    root = bucket + "/run"
    saved = distributed(gpus=2)(_save_and_resume).distributed(root, "save")
    fs = s3.fs()
    assert fs.cat_file("ckpt/run/latest").decode() == "step_00000003"
    names = {p.rsplit("/", 1)[-1] for p in fs.find("ckpt/run/step_00000003")}
    assert {"COMPLETE", "trainer_state.pt", "rng_rank00000.pt", "rng_rank00001.pt",
            "data_rank00000.pt", "data_rank00001.pt", ".metadata"} <= names
    assert saved[0]["left"] == []                       # the local stage is gone after upload
    loaded = distributed(gpus=2)(_save_and_resume).distributed(root, "load")
    for r in range(2):
        assert loaded[r]["step"] == 3 and loaded[r]["left"] == []
        assert loaded[r]["next"] == saved[r]["next"]     # the loader came back with the model
        for a, b in zip(saved[r]["weights"], loaded[r]["weights"]):
            assert torch.equal(a, b)


def test_failed_upload_never_becomes_latest(s3, tmp_path, monkeypatch):
    import s3fs

    from gpulaunch.parallel import latest_checkpoint, prepare, save_checkpoint, wait_for_checkpoint

    bucket = s3.make_bucket("ckpt")
    p = prepare(torch.nn.Linear(2, 1), lambda ps: torch.optim.SGD(ps, lr=0.1), strategy="none")
    save_checkpoint(bucket + "/run", p, step=1)
    wait_for_checkpoint()
    # a user who may read and list but not write: the next upload is refused
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.reader_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.reader_secret)
    s3fs.S3FileSystem.clear_instance_cache()
    save_checkpoint(bucket + "/run", p, step=2)            # returns: the upload runs behind
    with pytest.raises(Exception, match="(?i)denied|forbidden|permission"):
        wait_for_checkpoint()
    assert latest_checkpoint(bucket + "/run").endswith("step_00000001")
