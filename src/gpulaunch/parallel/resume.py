"""``resume()``: the resume pattern in one line, so a restarted run continues where it stopped.

    p = prepare(model, opt_factory, strategy="ddp", lr_scheduler=sched_factory)
    loader = distributed_loader(ds, batch_size=32, seed=0)
    step = resume("ckpts/", p, loader=loader)          # 0 on a fresh start
    for epoch in range(loader.state_dict()["epoch"], epochs):
        loader.set_epoch(epoch)
        for batch in loader:                            # continues after the batches seen
            ...; step += 1
            if step % 100 == 0:
                save_checkpoint("ckpts/", p, step=step, loader=loader)

What it restores (from the newest *complete* checkpoint: a save that crashed half-way is never
picked): model and optimizer (sharded DCP, or DeepSpeed's own), the lr scheduler and grad
scaler, gradient-accumulation position, each rank's RNG (torch, CUDA, Python, NumPy) when the
world size is the same, and the loader's epoch and batches consumed. On CPU that continuation
is bit-exact (``tests/parallel/test_resume.py``: a rank SIGKILLed mid-epoch, ``max_restarts=1``, final
weights equal to an uninterrupted run's).

The loader position comes from rank 0's count, which is every rank's: all ranks take the same
number of steps. A run that also needs its own values (a best loss, a config) passes
``extra=`` to ``save_checkpoint`` and reads it with ``load_checkpoint``.
"""

from __future__ import annotations

from .checkpoint import latest_checkpoint, load_checkpoint

__all__ = ["resume"]


def resume(root, prepared, *, loader=None, optimizer=None, strict: bool = True) -> int:
    """Load the newest complete checkpoint under ``root`` into ``prepared`` (and ``loader``);
    return its step, or 0 when there is none yet. Call it on every rank, after ``prepare``."""
    if latest_checkpoint(str(root)) is None:
        return 0
    return int(load_checkpoint(root, prepared, optimizer=optimizer, loader=loader,
                               strict=strict)["step"])
