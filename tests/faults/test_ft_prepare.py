"""``prepare(..., fault_tolerant=True)``: the Prepared loop under gpulaunch.ft.run_replicas, with a
real lighthouse, real gloo and a real SIGKILL; plus the refusals (fast, no processes)."""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import alive

torchft = pytest.importorskip("torchft")

import torch  # noqa: E402
from test_ft_replicas import (  # noqa: E402
    LR,
    _batch,
    _eval_loss,
    _failure_free_loss,
    _model,
    _monotonic,
    _no_process_left,
)

from gpulaunch import ft  # noqa: E402
from gpulaunch.ft.result import read_steps  # noqa: E402
from gpulaunch.parallel import Mesh, ParallelError, prepare, save_checkpoint  # noqa: E402

STEPS = 60


def _train_prepared(steps: int, pause: float):
    import time

    import torch

    from gpulaunch import ft
    from gpulaunch.parallel import prepare
    model = _model()
    p = prepare(model, lambda ps: torch.optim.Adam(ps, lr=LR), fault_tolerant=True)
    while p.committed_step < steps:
        x, y = _batch(p.committed_step, ft.replica_id())
        p.backward(torch.nn.functional.mse_loss(p.model(x), y))
        p.step()
        p.zero_grad()
        time.sleep(pause)
    out = p.summary()
    out["data"] = (p.data_rank, p.data_size, p.strategy)
    out["weights"] = torch.cat([q.detach().flatten() for q in p.unwrap().parameters()])
    out["eval_loss"] = _eval_loss(p.unwrap())
    p.shutdown()
    return out


@pytest.mark.slow
def test_prepared_loop_survives_a_sigkilled_group_and_heals(tmp_path, gpulaunch_home):
    killed = {}
    lighthouse_pids = []

    def kill_replica_1(groups):
        lighthouse_pids[:] = [groups.lighthouse.pid]
        if killed:
            return
        mine = read_steps(groups.ft_dir, 1)
        if mine and mine[-1]["step"] >= 15:
            pids = ft.group_pids(groups.ft_dir, 1, 0)
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            killed.update(step=mine[-1]["step"], t=time.time(), pids=pids)

    result = ft.run_replicas(_train_prepared, STEPS, 0.05, replicas=2, max_group_restarts=2,
                             ft_dir=str(tmp_path / "ft"), on_poll=kill_replica_1)

    assert killed, "the run ended before replica 1 reached step 15"
    assert [(f.replica, f.attempt, f.restarted) for f in result.failures] == [(1, 0, True)]
    assert result.failures[0].healed_to is not None and result.failures[0].healed_to >= killed["step"]
    survivor = result.steps[0]
    assert {r["a"] for r in survivor} == {0} and _monotonic(survivor)
    assert survivor[-1]["step"] == STEPS
    again = [r for r in result.steps[1] if r["a"] == 1]
    assert again[0].get("healed_to") == again[0]["step"] - 1 >= killed["step"]
    r0, r1 = result.results[0][0], result.results[1][0]
    assert r1["attempt"] == 1 and r1["healed_to"]
    assert r0["data"] == (0, 2, "ft") and r1["data"] == (1, 2, "ft")
    assert torch.equal(r0["weights"], r1["weights"])
    reference = _failure_free_loss(STEPS, 2)
    assert abs(r0["eval_loss"] - reference) <= 0.02, (r0["eval_loss"], reference)
    assert not alive(killed["pids"])
    _no_process_left(tmp_path / "ft", gpulaunch_home, lighthouse_pids)


def _train_accumulating(steps: int):
    import torch

    from gpulaunch import ft
    from gpulaunch.parallel import prepare
    model = _model()
    p = prepare(model, lambda ps: torch.optim.SGD(ps, lr=0.1), strategy="ddp", gradient_accumulation_steps=2,
                max_grad_norm=0.05, lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 5, 0.5),
                fault_tolerant=True)
    while p.committed_step < steps:
        for micro in range(2):
            with p.accumulate():
                x, y = _batch(p.committed_step, 2 * ft.replica_id() + micro)
                p.backward(torch.nn.functional.mse_loss(p.model(x), y))
            p.step()
            p.zero_grad()
    out = p.summary()
    out["lr"] = p.optimizer.param_groups[0]["lr"]
    out["weights"] = torch.cat([q.detach().flatten() for q in p.unwrap().parameters()])
    out["eval_loss"] = _eval_loss(p.unwrap())
    p.shutdown()
    return out


def test_accumulation_clipping_and_scheduler_work_under_torchft(tmp_path, gpulaunch_home):
    steps = 20
    result = ft.run_replicas(_train_accumulating, steps, replicas=2, ft_dir=str(tmp_path / "ft"))
    assert not result.failures
    r0, r1 = result.results[0][0], result.results[1][0]
    assert r0["step"] == r1["step"] == steps and r0["committed_steps"] == steps
    assert r0["lr"] == pytest.approx(0.1 * 0.5 ** 4)
    assert torch.equal(r0["weights"], r1["weights"])

    def reference(clip):
        """The same training in one process: 4 micro-batches per step, clipped, scheduled."""
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, 5, 0.5)
        for step in range(steps):
            opt.zero_grad()
            for i in range(4):
                x, y = _batch(step, i)
                (torch.nn.functional.mse_loss(model(x), y) / 4).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            sched.step()
        return _eval_loss(model)

    # (torchft's first quorum makes the run differ from the one-process one by a little, the
    # same for ft.replicated; clipping at 0.05 moves the loss by far more than that)
    assert abs(r0["eval_loss"] - reference(0.05)) <= 0.02, (r0["eval_loss"], reference(0.05))
    assert abs(r0["eval_loss"] - reference(None)) > 0.1


# ----------------------------------------------------------------------------- refusals (fast)
@pytest.fixture
def no_lighthouse(monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)


@pytest.fixture
def fake_lighthouse(monkeypatch):
    # only the variable: every refusal below fails before anything connects to it
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:1")


def _opt(ps):
    return torch.optim.SGD(ps, lr=0.1)


def test_outside_run_replicas_it_names_the_fix(no_lighthouse):
    with pytest.raises(ParallelError, match=r"ft\.run_replicas\("):
        prepare(torch.nn.Linear(2, 2), _opt, fault_tolerant=True)


@pytest.mark.parametrize("kwargs, match", [
    ({"strategy": "fsdp", "mixed_precision": "bf16"}, "strategy='fsdp' \\(HSDP\\) takes mixed_precision=None"),
    ({"strategy": "zero2"}, "cannot run strategy='zero2'"),
    ({"mesh": Mesh(shard=2)}, "takes no mesh="),
    ({"mesh": Mesh(tensor=2)}, "takes no mesh="),
    ({"mixed_precision": "fp16"}, "mixed_precision='fp16'"),
    ({"compile": True}, "compile"),
    ({"cpu_offload": True}, "cpu_offload"),
])
def test_options_that_cannot_work_are_refused_with_what_is_supported(fake_lighthouse, kwargs, match):
    with pytest.raises(ParallelError, match=match) as e:
        prepare(torch.nn.Linear(2, 2), _opt, fault_tolerant=True, **kwargs)
    assert "supports strategy='auto', 'none' or 'ddp'" in str(e.value)


def test_save_checkpoint_refuses_a_fault_tolerant_prepared(tmp_path):
    from gpulaunch.parallel.fault_tolerant import FaultTolerantPrepared
    p = FaultTolerantPrepared.__new__(FaultTolerantPrepared)
    p.strategy = "ft"
    with pytest.raises(ParallelError, match="heals from a live peer"):
        save_checkpoint(str(tmp_path), p, step=1)
