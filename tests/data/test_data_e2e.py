"""Real ranks (gloo) reading a Delta table with a deleted row through StreamingLoader: a rank
SIGKILLed mid-epoch and the run restarted, at the same world size (max_restarts) and at another
one (a new launch on the same checkpoints), ends having seen each live row exactly once; at the
same world size the weights equal an uninterrupted run's."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
import torch
from data_fixtures import write_delta

from gpulaunch import distributed
from gpulaunch import runtime as rt
from gpulaunch.errors import DataError, RunError

LIVE = [i for i in range(101) if i != 42]


def _train(table: str, ckpt: str, log_dir: str, crash_at: int | None, workers: int, tag: str):
    from gpulaunch.data import StreamingDataset, StreamingLoader
    from gpulaunch.parallel import prepare, resume, save_checkpoint

    rt.init()
    torch.manual_seed(0)
    p = prepare(torch.nn.Linear(1, 1), lambda ps: torch.optim.SGD(ps, lr=0.05), strategy="ddp")
    loader = StreamingLoader(StreamingDataset(table, columns=["id", "x"], seed=3, shuffle_rows=16),
                             batch_size=4, num_workers=workers)
    step = start = resume(ckpt, p)          # the loader's position comes back by itself
    log = Path(log_dir) / f"{tag}-a{rt.get_restart_count()}-r{rt.get_global_rank()}.txt"
    for _ in loader.epochs(1):
        for batch in loader:
            if step == crash_at and rt.get_restart_count() == 0 and rt.get_global_rank() == 1:
                os.kill(os.getpid(), 9)
            x = batch["x"].unsqueeze(1)
            loss = (p.model(x) - 2 * x).pow(2).mean()
            p.backward(loss)
            p.step()
            p.zero_grad()
            step += 1
            with open(log, "a") as f:
                f.write(f"{step} {','.join(map(str, batch['id'].tolist()))}\n")
            if step % 3 == 0:
                save_checkpoint(ckpt, p, step=step)
    return {"start": start, "steps": step, "world": rt.get_world_size(),
            "weights": [t.detach().clone() for t in p.model.module.parameters()]}


def _seen(log_dir: Path, tag: str, upto: dict[int, int]) -> Counter:
    """Rows trained on by launch ``tag``: attempt a's steps <= upto[a] (later ones were redone)."""
    seen = Counter()
    for f in log_dir.glob(f"{tag}-a*-r*.txt"):
        attempt = int(f.name.split("-a")[1].split("-")[0])
        for line in f.read_text().splitlines():
            step, ids = line.split(" ", 1)
            if int(step) <= upto.get(attempt, 10 ** 9):
                seen.update(int(i) for i in ids.split(","))
    return seen


@pytest.mark.slow
def test_killed_and_restarted_runs_see_each_row_once(tmp_path):
    table = write_delta(tmp_path / "table", 101, delete={42})
    logs = tmp_path / "logs"
    logs.mkdir()
    clean = distributed(gpus=2)(_train).distributed(table, str(tmp_path / "c0"), str(logs), None,
                                                    2, "clean")
    assert clean[0]["steps"] == 13 and clean[0]["start"] == 0            # ceil(50 / 4)
    assert _seen(logs, "clean", {}) == Counter(LIVE)

    # same world size: a rank SIGKILLed at step 7, restarted by max_restarts from step 6
    same = distributed(gpus=2, max_restarts=1)(_train).distributed(
        table, str(tmp_path / "c1"), str(logs), 7, 2, "same")
    assert same[0]["start"] == 6 and same[0]["steps"] == 13
    assert _seen(logs, "same", {0: 6}) == Counter(LIVE)
    for a, b in zip(clean[0]["weights"], same[0]["weights"]):
        assert torch.equal(a, b)

    # another world size: the 2-rank run dies at step 7; 3 ranks (1 worker each) go on
    with pytest.raises(RunError):
        distributed(gpus=2)(_train).distributed(table, str(tmp_path / "c2"), str(logs), 7, 2,
                                                "grow0")
    grown = distributed(gpus=3)(_train).distributed(table, str(tmp_path / "c2"), str(logs),
                                                    None, 1, "grow1")
    assert grown[0]["start"] == 6 and grown[0]["world"] == 3
    assert _seen(logs, "grow0", {0: 6}) + _seen(logs, "grow1", {}) == Counter(LIVE)


def _read_then_sync(path: str):
    import torch.distributed as dist

    from gpulaunch.data import StreamingDataset, StreamingLoader

    rt.init()
    loader = StreamingLoader(StreamingDataset(path, shuffle=False), 4, num_workers=1)
    for batch in loader:
        dist.all_reduce(torch.ones(1))        # a collective per step, as training has
    return len(loader)


def test_a_bad_shard_on_one_rank_fails_the_call_and_names_it(tmp_path):
    folder = tmp_path / "chats"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(f'{{"id": {i}}}\n' for i in range(8)))
    (folder / "b.jsonl").write_text('{"id": 8}\n{"id": \n' * 4)   # rank 1's rows: broken JSON
    t = __import__("time").monotonic()
    with pytest.raises(DataError, match=r"b\.jsonl.*not JSON lines"):
        distributed(gpus=2)(_read_then_sync).distributed(str(folder))
    assert __import__("time").monotonic() - t < 240        # the waiting rank was stopped
