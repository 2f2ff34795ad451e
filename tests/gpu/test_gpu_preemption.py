"""A preemption notice on GPU ranks (NCCL): every rank saves the same step and the restarted
attempt resumes from it with the weights the uninterrupted run has. On several GPUs the
per-step agreement travels on a gloo group of its own (no stream synchronisation per step)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gpulaunch import distributed
from gpulaunch.common import preemption

pytestmark = pytest.mark.gpu
STEPS = 40


def train_gpu(ckpt: str, steps: int):
    import torch

    from gpulaunch import runtime as rt
    from gpulaunch.parallel import prepare, resume, save_on_preemption
    dev = rt.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 1)).to(dev)
    p = prepare(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), strategy="ddp")
    step = start = resume(ckpt, p)
    rank = rt.get_global_rank()
    while step < steps:
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(32, 64, generator=g).to(dev)
        p.backward((p.model(x) - x.sum(1, keepdim=True).tanh()).pow(2).mean())
        p.step()
        p.zero_grad()
        step += 1
        if rank == 0:
            with open(ckpt + ".progress", "a") as f:
                f.write(f"{step}\n")
        save_on_preemption(ckpt, p, step=step)
        time.sleep(0.05)
    return {"start": start, "attempt": rt.get_restart_count(),
            "weights": [t.detach().cpu() for t in p.model.module.parameters()]}


@pytest.mark.parametrize("gpus", [1, pytest.param(2, marks=pytest.mark.gpus(2))])
def test_gpu_notice_saves_and_the_restart_resumes(tmp_path, gpus):
    import torch
    clean = distributed(gpus=gpus)(train_gpu).distributed(str(tmp_path / "clean"), STEPS)
    ckpt = str(tmp_path / "ck")
    h = distributed(gpus=gpus, max_preemptions=1)(train_gpu).submit(ckpt, STEPS)
    progress = Path(ckpt + ".progress")
    deadline = time.monotonic() + 300
    while not (progress.exists() and len(progress.read_text().split()) >= 5):
        assert time.monotonic() < deadline, "the run never reached step 5"
        time.sleep(0.05)
    notice = h.preempt(grace_s=60)
    out = h.result(timeout=300)
    saved = preemption.read_saved(h.run_dir, 0)
    assert saved["saved_at"] - notice.received_at < 60
    assert out[0]["attempt"] == 1 and out[0]["start"] == saved["step"]
    assert (h.preemptions, h.failures) == (1, 0)
    for a, b in zip(out, clean):
        for x, y in zip(a["weights"], b["weights"]):
            torch.testing.assert_close(x, y)       # CUDA kernels: equal within tolerance
