"""``max_restarts`` with a Distributed Checkpoint on GPU: a rank is SIGKILLed mid-training, the
group restarts, resumes from the newest complete checkpoint, and its final weights are bit-equal
to those of the same training run without interruption.

Deterministic settings make "equal" meaningful on a GPU: a model of matmuls and elementwise ops
only (no attention, no embedding: their fast backward kernels accumulate with atomics),
``CUBLAS_WORKSPACE_CONFIG=:4096:8``, ``torch.use_deterministic_algorithms(True,
warn_only=True)`` (a warning it raises is returned and recorded), fp32, and data that depend on
the step alone. FSDP2 (sharded DTensor state through DCP) over every GPU of the host.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from gpulaunch import runtime as rt

from .helpers import wait_gpu_released

pytestmark = pytest.mark.gpu
DIM, GLOBAL_BATCH, STEPS, SAVE_EVERY, KILL_AFTER = 256, 64, 12, 4, 6


def _net():
    import torch
    from torch import nn
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(DIM, DIM), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(DIM, 1))


def _train_step(p, step: int, device) -> float:
    import torch
    rank, world = rt.get_global_rank(), rt.get_world_size()
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(GLOBAL_BATCH, DIM, generator=g)
    y = torch.tanh(x[:, :8].sum(-1, keepdim=True))
    n = GLOBAL_BATCH // world
    x, y = x[rank * n:(rank + 1) * n].to(device), y[rank * n:(rank + 1) * n].to(device)
    loss = torch.nn.functional.mse_loss(p.model(x), y)
    p.backward(loss)
    p.step()
    p.zero_grad()
    return loss.item()


def _full_weights(p) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(p.model, options=StateDictOptions(full_state_dict=True,
                                                                  cpu_offload=True))


def train_killed_then_resumed(ckpt_root: str) -> dict:
    import warnings

    import torch

    from gpulaunch import parallel as gp
    torch.use_deterministic_algorithms(True, warn_only=True)
    dev = rt.init()
    rank, world, attempt = rt.get_global_rank(), rt.get_world_size(), rt.get_restart_count()

    def opt(ps):
        return torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = gp.prepare(_net(), opt, strategy="fsdp")
        start = 0
        if gp.latest_checkpoint(ckpt_root) is not None:
            start = gp.load_checkpoint(ckpt_root, p)["step"]
        losses = {}
        for step in range(start + 1, STEPS + 1):
            losses[step] = _train_step(p, step, dev)
            if step % SAVE_EVERY == 0:
                gp.save_checkpoint(ckpt_root, p, step=step)
            if attempt == 0 and step == KILL_AFTER and rank == world - 1:
                os.kill(os.getpid(), signal.SIGKILL)      # mid-training, after step 4's save
        resumed = _full_weights(p)
        q = gp.prepare(_net(), opt, strategy="fsdp")      # the same run, never interrupted
        straight_losses = {step: _train_step(q, step, dev) for step in range(1, STEPS + 1)}
        straight = _full_weights(q)
    odd = sorted({str(w.message)[:300] for w in caught if "determinis" in str(w.message)})
    out = {"attempt": attempt, "start": start, "losses": losses, "straight_losses": straight_losses}
    if rank == 0:
        out.update(resumed=resumed, straight=straight, nondeterministic_warnings=odd)
    return out


@pytest.mark.timeout(180)
def test_a_killed_rank_restarts_from_the_checkpoint_and_ends_bit_equal(gpu, record, keep,
                                                                         tmp_path):
    import torch

    from gpulaunch import distributed
    job = distributed(max_restarts=1, timeout=150, stream_logs="none",
                      env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})(train_killed_then_resumed)
    handle = job.submit(str(tmp_path / "ckpt"))
    keep(handle.run_dir)
    results = handle.result(timeout=170)
    run = Path(handle.run_dir)
    history = json.loads((run / "status.json").read_text()).get("history") or []
    assert len(history) == 1, f"expected one restart, status history: {history}"
    killed = history[0]["failures"]
    assert {int(r) for r in killed} >= {gpu.count - 1}, killed
    assert killed[str(gpu.count - 1)]["exitcode"] == -signal.SIGKILL, killed
    assert [r["attempt"] for r in results] == [1] * gpu.count
    assert [r["start"] for r in results] == [SAVE_EVERY] * gpu.count, "did not resume at step 4"

    r0 = results[0]
    assert r0["resumed"].keys() == r0["straight"].keys() and r0["resumed"]
    diffs = {k: (r0["resumed"][k] - r0["straight"][k]).abs().max().item() for k in r0["resumed"]}
    # the loss of every resumed step is the uninterrupted run's, and so are the weights
    for step, loss in r0["losses"].items():
        assert loss == r0["straight_losses"][step], (step, loss, r0["straight_losses"][step])
    assert all(torch.equal(r0["resumed"][k], r0["straight"][k]) for k in diffs), (
        f"weights after resuming differ from the uninterrupted run (max |diff| per tensor: "
        f"{diffs}); deterministic-algorithm warnings: {r0['nondeterministic_warnings']}")
    record(max_abs_diff=max(diffs.values()), nondeterministic_warnings=r0[
        "nondeterministic_warnings"], losses=r0["losses"])
    wait_gpu_released(run, gpu.baseline_mib)
