"""``save_on_preemption()``: a just-in-time checkpoint when the run is preempted.

    step = resume("ckpts/", p, loader=loader)
    while step < steps:
        ...one training step...; step += 1
        save_on_preemption("ckpts/", p, step=step, loader=loader)   # every step, every rank

Every call asks every rank whether a notice has come (``rt.preemption()``, then one all-reduce
of a flag: a notice may reach the ranks one step apart, and they must all save the same
step). When one has, every rank saves the checkpoint of this step (the one collective save of
``save_checkpoint``; a save in flight is finished first), rank 0 records it in the run
directory, and every rank raises ``PreemptedError`` naming the step: the run ends here, and
the caller restarts it from that checkpoint (``max_preemptions``) or, when the caller itself is
going away, stops with that message; the next start resumes from it.

The save is synchronous on purpose: the process ends right after it, so a background write
would only add the staging copy to the time before the checkpoint is published.
"""

from __future__ import annotations

import os
import time

from .. import runtime as rt
from ..common import preemption
from ..errors import PreemptedError
from .checkpoint import save_checkpoint

__all__ = ["save_on_preemption", "preemption_agreed"]


_FLAG_GROUPS: dict = {}


def _flag_group(dist):
    """The group the flag travels on: the default one when it is gloo; else a gloo group of
    its own (created once, by every rank at the same call), so that on GPUs the per-step check
    is a CPU exchange that never waits for the GPU's queued work (an NCCL all-reduce read back
    with ``.item()`` would synchronise the stream every step)."""
    if dist.get_backend() == "gloo":
        return None
    key = id(dist.group.WORLD)
    if key not in _FLAG_GROUPS:
        _FLAG_GROUPS[key] = dist.new_group(backend="gloo")
    return _FLAG_GROUPS[key]


def preemption_agreed():
    """The notice if ANY rank has seen one (a collective: call it on every rank at the same
    point), else None."""
    notice = rt.preemption()
    dist = rt._dist()
    if dist is None or dist.get_world_size() == 1:
        return notice
    import torch
    flag = torch.tensor([1 if notice is not None else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=_flag_group(dist))
    if not int(flag.item()):
        return None
    if notice is None:                  # a peer saw it first; the file is there by now
        for _ in range(100):
            notice = rt.preemption()
            if notice is not None:
                break
            time.sleep(0.01)
    return notice or preemption.PreemptionNotice("a peer rank", time.time(), time.time())


def save_on_preemption(path, prepared, *, step: int, loader=None, extra=None, optimizer=None,
                       keep: int | None = None, every: int = 1) -> None:
    """No notice: return at once (after one tiny all-reduce on CPU). A notice: save the
    checkpoint of ``step`` under ``path`` on every rank (as ``save_checkpoint``), then raise
    ``PreemptedError``. Call it on every rank, once per step, after the optimizer step;
    ``every=N`` looks only at steps that are multiples of N (very short steps; a notice then
    waits up to N steps)."""
    if every > 1 and step % every:
        return
    notice = preemption_agreed()
    if notice is None:
        return
    ckpt = save_checkpoint(path, prepared, step=step, loader=loader, extra=extra,
                           optimizer=optimizer, keep=keep)
    took = time.time() - notice.received_at
    run_dir = rt.get_run_dir()
    if rt.get_global_rank() == 0 and run_dir:
        preemption.write_saved(run_dir, rt.get_restart_count(), step=step, checkpoint=ckpt,
                               notice=notice)
    dist = rt._dist()
    if dist is not None and dist.get_world_size() > 1:
        dist.barrier()      # the record is there before any rank's exit tells the agent
    left = notice.remaining()
    # a notice that allows a restart restarts here only within max_preemptions (default 0)
    where = ("the run restarts from it here" if notice.restart
             and preemption.max_preemptions(os.environ) > 0
             else "the next start resumes from it (parallel.resume)")
    raise PreemptedError(
        f"Preempted ({notice.source}, grace {notice.grace_s:.3g} s): checkpoint of step {step} "
        f"saved in {ckpt}, {took:.2f} s after the notice ({left:.2f} s of the grace left); "
        f"{where}.", step=int(step), checkpoint=str(ckpt), rank=rt.get_global_rank())
