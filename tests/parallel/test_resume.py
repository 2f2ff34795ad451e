"""``resume()``: a restarted run continues at the step, batch and random state where it stopped,
bit-exact on CPU (real ranks, a real SIGKILL, real checkpoints)."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from gpulaunch import distributed
from gpulaunch import runtime as rt
from gpulaunch.parallel import ShardedFileDataset, distributed_loader


def _batches(loader, n=None):
    out = []
    for b in loader:
        out.append(b[0].clone() if isinstance(b[0], torch.Tensor) else list(b))
        if n is not None and len(out) == n:
            break
    return out


def _dataset():
    return TensorDataset(torch.arange(40, dtype=torch.float32).unsqueeze(1))


def test_loader_position_round_trip_map_style():
    whole = distributed_loader(_dataset(), 3, seed=5, rank=1, world_size=2)
    whole.set_epoch(1)
    expected = _batches(whole)                    # epoch 1 of rank 1, uninterrupted
    first = distributed_loader(_dataset(), 3, seed=5, rank=1, world_size=2)
    first.set_epoch(1)
    seen = _batches(first, 4)
    state = first.state_dict()
    assert state == {"epoch": 1, "batches": 4}
    again = distributed_loader(_dataset(), 3, seed=5, rank=1, world_size=2)
    again.load_state_dict(state)
    again.set_epoch(1)                            # what the resumed loop calls: keeps the skip
    rest = _batches(again)
    assert [t.tolist() for t in seen + rest] == [t.tolist() for t in expected]
    assert again.state_dict() == {"epoch": 1, "batches": len(expected)}
    # The skip is for that one pass: the next epoch is whole again.
    again.set_epoch(2)
    assert len(_batches(again)) == len(expected)


def test_loader_position_round_trip_sharded_files(tmp_path):
    for i in range(4):
        (tmp_path / f"f{i}.txt").write_text("".join(f"{i}-{j}\n" for j in range(5)))
    make = lambda: distributed_loader(  # noqa: E731
        ShardedFileDataset(str(tmp_path / "*.txt"), seed=3, rank=0, world_size=2), 2,
        rank=0, world_size=2)
    whole = make()
    expected = _batches(whole)
    first = make()
    seen = _batches(first, 3)
    again = make()
    again.load_state_dict(first.state_dict())
    assert seen + _batches(again) == expected


def _train(ckpt: str, crash_at_step: int | None):
    import os

    import torch.distributed as dist

    from gpulaunch.parallel import prepare, resume, save_checkpoint
    rt.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1, 16), torch.nn.Dropout(0.2),
                                torch.nn.Tanh(), torch.nn.Linear(16, 1))
    p = prepare(model, lambda ps: torch.optim.AdamW(ps, lr=1e-2), strategy="ddp",
                lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 3, gamma=0.7))
    loader = distributed_loader(_dataset(), 4, seed=11)      # 5 batches per epoch per rank
    step = start = resume(ckpt, p, loader=loader)
    seen = []
    for epoch in range(loader.state_dict()["epoch"], 3):
        loader.set_epoch(epoch)
        for (x,) in loader:
            if step == crash_at_step and rt.get_restart_count() == 0 and rt.get_global_rank() == 1:
                os.kill(os.getpid(), 9)          # mid-epoch, between two checkpoints
            noise = torch.randn(x.shape)         # RNG in the step: must continue exactly
            loss = (p.model(x) - (x * 0.1 + noise * 0.01)).pow(2).mean()
            p.backward(loss)
            p.step()
            p.zero_grad()
            step += 1
            seen.append((step, x.flatten().tolist()))
            if step % 4 == 0:
                save_checkpoint(ckpt, p, step=step, loader=loader, keep=2)
    dist.barrier()
    return {"start": start, "restarts": rt.get_restart_count(), "seen": seen,
            "lr": p.optimizer.param_groups[0]["lr"],
            "weights": [t.detach().clone() for t in p.model.module.parameters()]}


def test_killed_rank_resumes_bit_exact(tmp_path):
    clean = distributed(gpus=2)(_train).distributed(str(tmp_path / "a"), None)
    crashed = distributed(gpus=2, max_restarts=1)(_train).distributed(str(tmp_path / "b"), 10)
    assert clean[0]["start"] == 0 and clean[0]["restarts"] == 0
    assert crashed[0]["restarts"] == 1
    assert crashed[0]["start"] == 8                # the newest complete checkpoint
    for rank in (0, 1):
        # The resumed run saw exactly the batches the uninterrupted one saw after step 8 ...
        assert crashed[rank]["seen"] == [s for s in clean[rank]["seen"] if s[0] > 8]
        # ... and ends with bit-identical weights and schedule.
        assert crashed[rank]["lr"] == clean[rank]["lr"]
        for a, b in zip(clean[rank]["weights"], crashed[rank]["weights"]):
            assert torch.equal(a, b)


def test_resume_without_a_checkpoint_starts_at_zero(tmp_path):
    from gpulaunch.parallel import prepare, resume
    p = prepare(torch.nn.Linear(2, 2), lambda ps: torch.optim.SGD(ps, lr=0.1), strategy="none")
    assert resume(tmp_path / "none-yet", p) == 0
