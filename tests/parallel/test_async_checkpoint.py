"""``save_checkpoint(..., async_save=True)``: training goes on while the checkpoint is written;
what lands is the state at the save, published atomically; a crash mid-write leaves the previous
checkpoint the latest. Real ranks, real files, a real SIGKILL."""

from __future__ import annotations

import os
import subprocess
import textwrap

import torch
from conftest import PY, python_env

from gpulaunch import distributed
from gpulaunch import runtime as rt


def _train_and_save_async(root: str):
    from gpulaunch.parallel import (
        latest_checkpoint,
        load_checkpoint,
        prepare,
        save_checkpoint,
        wait_for_checkpoint,
    )
    rt.init()
    torch.manual_seed(0)

    def make():
        return prepare(torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Linear(64, 1)),
                       lambda ps: torch.optim.AdamW(ps, lr=0.05), strategy="ddp")

    def step(p, i):
        x = torch.full((8, 4), float(i + rt.get_global_rank()))
        p.backward(p.model(x).pow(2).mean())
        p.step()
        p.zero_grad()

    p = make()
    step(p, 0)
    at_save = [t.detach().clone() for t in p.model.module.parameters()]
    save_checkpoint(root, p, step=1, async_save=True)
    for i in range(1, 4):
        step(p, i)                     # training changes every parameter meanwhile
    done = wait_for_checkpoint()
    latest = latest_checkpoint(root)
    q = make()
    load_checkpoint(root, q)
    loaded = [t.detach().clone() for t in q.model.module.parameters()]
    moments = q.optimizer.state_dict()["state"][0]["exp_avg"].clone()
    # One more, left in flight: the end of the function must wait for it.
    save_checkpoint(root, p, step=4, async_save=True, keep=1)
    return {"done": done, "latest": latest, "at_save": at_save, "loaded": loaded,
            "moments": moments, "moved": not torch.equal(at_save[0], loaded[0] * 0 +
                                                          p.model.module[0].weight.detach())}


def test_async_save_writes_the_state_at_the_save_while_training_goes_on(tmp_path):
    from gpulaunch.parallel import latest_checkpoint, list_checkpoints
    root = str(tmp_path / "ck")
    out = distributed(gpus=2)(_train_and_save_async).distributed(root)
    for r in out:
        assert r["done"] == r["latest"] == os.path.join(root, "step_00000001")
        assert r["moved"]                               # training did change the weights
        for a, b in zip(r["at_save"], r["loaded"]):
            assert torch.equal(a, b)                    # ... but the checkpoint has step 1's
        assert torch.count_nonzero(r["moments"]) > 0    # optimizer state came along
    # The save left in flight at the function's end was completed and published.
    assert latest_checkpoint(root) == os.path.join(root, "step_00000004")
    assert [s for s, _ in list_checkpoints(root)] == [4]        # keep=1 pruned step 1
    assert not [n for n in os.listdir(root) if n.startswith(".tmp-")]


CRASH = textwrap.dedent("""
    import os, sys, torch
    from gpulaunch.parallel import save_checkpoint
    root = sys.argv[1]
    model = torch.nn.Linear(8192, 8192)                 # 256 MiB: a write takes a while
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    save_checkpoint(root, model, optimizer=opt, step=1)
    with torch.no_grad():
        model.weight.add_(1)
    save_checkpoint(root, model, optimizer=opt, step=2, async_save=True)
    os.kill(os.getpid(), 9)                             # dies while step 2 is being written
""")


def test_crash_during_async_save_leaves_the_previous_checkpoint_latest(tmp_path):
    from gpulaunch.parallel import latest_checkpoint, list_checkpoints, load_checkpoint
    root = str(tmp_path / "ck")
    script = tmp_path / "crash.py"
    script.write_text(CRASH)
    p = subprocess.run([PY, str(script), root], env=python_env(), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == -9, p.stdout + p.stderr
    partial = [n for n in os.listdir(root) if n.startswith(".tmp-step_00000002")]
    assert partial, os.listdir(root)                    # it did die mid-save ...
    assert not os.path.exists(os.path.join(root, partial[0], "COMPLETE"))
    assert latest_checkpoint(root) == os.path.join(root, "step_00000001")   # ... harmlessly
    assert [s for s, _ in list_checkpoints(root)] == [1]
    model = torch.nn.Linear(8192, 8192)
    with torch.no_grad():
        model.weight.zero_()
    load_checkpoint(root, model)
    assert torch.count_nonzero(model.weight) > 0        # step 1's weights, loadable
