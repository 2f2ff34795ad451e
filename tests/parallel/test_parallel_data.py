"""Data helpers: DistributedSampler loader and ShardedFileDataset, pure checks and 2 real gloo ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from test_parallel import run_ranks  # noqa: E402

from gpulaunch import parallel as gp  # noqa: E402
from gpulaunch.errors import DataError  # noqa: E402


def _files(tmp_path, n=10, lines=3):
    paths = []
    for i in range(n):
        p = tmp_path / f"part-{i:03d}.txt"
        p.write_text("".join(f"f{i}-l{j}\n" for j in range(lines)))
        paths.append(str(p))
    return paths


@pytest.mark.parametrize("n_files,world,workers", [(12, 2, 3), (13, 2, 3), (5, 3, 2), (4, 1, 1)])
def test_streams_are_disjoint_cover_all_and_even(tmp_path, n_files, world, workers):
    files = _files(tmp_path, n_files, 1)
    ds = gp.ShardedFileDataset(files, world_size=world, rank=0, seed=3)
    streams = [ds.files_for(r, w, workers) for r in range(world) for w in range(workers)]
    assert len({len(s) for s in streams}) == 1  # every stream the same number of files
    flat = [f for s in streams for f in s]
    assert set(flat) == set(files)  # nothing lost
    if n_files % (world * workers) == 0:
        assert len(flat) == len(set(flat))  # disjoint
    else:  # padded by repeating, as DistributedSampler does; fewest repeats possible
        assert len(flat) - len(set(flat)) == (world * workers) - n_files % (world * workers)
    dropped = gp.ShardedFileDataset(files, world_size=world, rank=0, seed=3, drop_last=True)
    if n_files >= world * workers:
        d = [f for r in range(world) for w in range(workers) for f in dropped.files_for(r, w, workers)]
        assert len(d) == len(set(d)) == n_files - n_files % (world * workers)


def test_epoch_reshuffles_identically_on_all_ranks(tmp_path):
    files = _files(tmp_path, 16, 1)
    a = gp.ShardedFileDataset(files, world_size=2, rank=0, seed=1)
    b = gp.ShardedFileDataset(files, world_size=2, rank=1, seed=1)
    e0 = [a.files_for(0, 0, 1, epoch=0), b.files_for(1, 0, 1, epoch=0)]
    e1 = [a.files_for(0, 0, 1, epoch=1), b.files_for(1, 0, 1, epoch=1)]
    assert e0 != e1
    for e in (e0, e1):
        assert set(e[0]).isdisjoint(e[1]) and set(e[0]) | set(e[1]) == set(files)


def test_glob_and_url_inputs(tmp_path):
    _files(tmp_path, 4, 2)
    ds = gp.ShardedFileDataset(str(tmp_path / "part-*.txt"), world_size=1, rank=0, shuffle=False)
    assert len(ds.files) == 4 and list(ds)[:2] == ["f0-l0", "f0-l1"]
    ds = gp.ShardedFileDataset(f"file://{tmp_path}/part-*.txt", world_size=1, rank=0, shuffle=False)
    assert all(f.startswith("file://") for f in ds.files) and len(list(ds)) == 8
    with pytest.raises(DataError, match="no files"):
        gp.ShardedFileDataset(str(tmp_path / "nothing-*.txt"))


class Rand(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.rand(1).item()


def job_loaders(files, url_files):
    rank = dist.get_rank()
    out = {}
    ds = gp.ShardedFileDataset(files, seed=5)
    loader = gp.distributed_loader(ds, batch_size=4, num_workers=2)
    out["files_e0"] = [x for b in loader for x in b]
    loader.set_epoch(1)
    out["files_e1"] = [x for b in loader for x in b]
    out["url"] = [x for b in gp.distributed_loader(gp.ShardedFileDataset(url_files), batch_size=2) for x in b]
    # map-style: DistributedSampler, per-rank disjoint, reshuffled by set_epoch
    tds = torch.utils.data.TensorDataset(torch.arange(20))
    ml = gp.distributed_loader(tds, batch_size=3, shuffle=True, seed=0)
    out["map_e0"] = [int(v) for (b,) in ml for v in b]
    ml.set_epoch(1)
    out["map_e1"] = [int(v) for (b,) in ml for v in b]
    # worker seeding: random numbers differ across ranks and workers, reproducibly
    rl = gp.distributed_loader(Rand(), batch_size=1, shuffle=False, num_workers=2)
    out["rand"] = [float(b) for b in rl]
    out["rand_again"] = [float(b) for b in rl]
    # every rank must use the same num_workers
    try:
        gp.distributed_loader(gp.ShardedFileDataset(files), batch_size=2, num_workers=1 + rank)
        out["mismatch"] = None
    except DataError as e:
        out["mismatch"] = str(e)
    return out


@pytest.mark.slow
def test_loaders_on_two_ranks(tmp_path):
    files = _files(tmp_path, 8, 3)
    res = run_ranks(job_loaders, files, [f"file://{f}" for f in files[:4]])
    every_line = {f"f{i}-l{j}" for i in range(8) for j in range(3)}
    for key in ("files_e0", "files_e1"):
        a, b = res[0][key], res[1][key]
        assert len(a) == len(b) == 12  # 8 files / (2 ranks x 2 workers) = 2 files = 6 lines per worker
        assert set(a).isdisjoint(b) and set(a) | set(b) == every_line
    assert res[0]["files_e0"] != res[0]["files_e1"]
    assert set(res[0]["url"]).isdisjoint(res[1]["url"]) and len(res[0]["url"]) == 6
    for key in ("map_e0", "map_e1"):
        a, b = res[0][key], res[1][key]
        assert set(a).isdisjoint(b) and set(a) | set(b) == set(range(20))
    assert res[0]["map_e0"] != res[0]["map_e1"]
    r0, r1 = res[0]["rand"], res[1]["rand"]
    assert len(set(r0 + r1)) == len(r0 + r1)  # distinct per rank and worker
    assert res[0]["rand_again"] == r0  # same epoch -> same seeds
    for r in res:
        assert r["mismatch"] and "same num_workers" in r["mismatch"]
