"""``prepare(..., fault_tolerant=True)``: the :class:`Prepared` loop API, backed by
:func:`gpulaunch.ft.replicated` (torchft's Manager), for a function started by
:func:`gpulaunch.ft.run_replicas`.

torchft averages gradients across the live groups at each step, and a restarted group heals from
a live peer. A group of one rank runs torchft's DDP (strategy 'auto', 'none' or 'ddp'); a group of
several ranks (``run_replicas(ranks_per_group=K)``) runs HSDP: ``strategy='fsdp'`` (or 'auto')
shards the model with FSDP2 over the group's ranks and torchft replicates the shards across groups
(:mod:`gpulaunch.ft.sharded`). It is an option rather than a strategy because torchft's process
group replaces the one the strategies replicate over.
"""

from __future__ import annotations

import contextlib
import os

import torch

from . import _env
from ._env import ParallelError
from ._optim import build_optimizer
from .ddp import autocast_forward
from .prepared import TorchPrepared

__all__ = ["FaultTolerantPrepared", "check_fault_tolerant", "prepare_fault_tolerant"]

_SUPPORTED = ("fault_tolerant=True supports strategy='auto', 'none' or 'ddp' (one rank per replica group, "
              "torchft replicating across groups) or 'fsdp' (HSDP: FSDP2 inside a group of "
              "run_replicas(ranks_per_group=K) ranks, torchft across groups), mixed_precision=None or 'bf16' "
              "(None with 'fsdp'), gradient_accumulation_steps, max_grad_norm and lr_scheduler")


def _shards(name: str) -> bool:
    """HSDP for 'fsdp', and for 'auto' in a group of several ranks (one has nothing to shard)."""
    return name == "fsdp" or (name == "auto" and _env.world_size() > 1)


def check_fault_tolerant(s, name: str) -> None:
    """Refuse what cannot work under torchft, before anything is built."""
    if name not in ("auto", "none", "ddp", "fsdp"):
        raise ParallelError(f"fault_tolerant=True cannot run strategy={name!r}: torchft replicates the model "
                            f"(or its FSDP2 shards) across replica groups. {_SUPPORTED}.")
    if _shards(name) and s.mixed_precision is not None:
        raise ParallelError(f"fault_tolerant=True with strategy={name!r} (HSDP) takes mixed_precision=None for "
                            f"now: FSDP2's MixedPrecisionPolicy is not wired to torchft's gradient all-reduce. "
                            f"{_SUPPORTED}.")
    if s.mesh is not None and any(n > 1 for n in (s.mesh.replicate, s.mesh.shard, s.mesh.context, s.mesh.tensor)):
        raise ParallelError(f"fault_tolerant=True takes no mesh= (got {s.mesh}): sharded, tensor- or "
                            f"context-parallel layouts need one process group that torchft replaces. {_SUPPORTED}.")
    bad = [n for n, v in (("cpu_offload", s.cpu_offload), ("precision='fp8'", s.precision == "fp8"),
                          ("mixed_precision='fp16'", s.mixed_precision == "fp16"),
                          ("compile", s.compile is not None),
                          ("activation_checkpointing", s.activation_checkpointing),
                          ("deepspeed_config", s.deepspeed_config), ("fsdp_kwargs", s.fsdp_kwargs),
                          ("ddp_kwargs", s.ddp_kwargs)) if v]
    if bad:
        raise ParallelError(f"fault_tolerant=True does not take {', '.join(bad)}. {_SUPPORTED}.")
    from ..ft.replicated import ENV_LIGHTHOUSE
    if not os.environ.get(ENV_LIGHTHOUSE):
        raise ParallelError("prepare(..., fault_tolerant=True) needs replica groups and a torchft lighthouse: "
                            "start the training function with gpulaunch.ft.run_replicas(fn, ..., replicas=N) "
                            "(it starts both), or use strategy='ddp' without fault_tolerant.")


class FaultTolerantPrepared(TorchPrepared):
    """:class:`Prepared` under torchft. ``step()`` returns False when the step was dropped (a peer
    failed mid-step, or not enough groups were live); ``committed_step`` is the run's step (it
    jumps forward when this group heals); ``replicated`` is the :class:`gpulaunch.ft.Replicated`."""

    def __init__(self, replicated, s, scheduler):
        super().__init__("ft", replicated.model, replicated.optimizer, s.device, s.mixed_precision,
                         s.gradient_accumulation_steps, s.max_grad_norm, scheduler, None, None)
        self.replicated = replicated
        self._inner_module = replicated.model.module
        self._quorum = False       # torchft's quorum for this step started (optimizer.zero_grad())

    def _open(self):
        if not self._quorum:
            self.optimizer.zero_grad(set_to_none=True)   # starts the step's quorum
            self._quorum = True

    def backward(self, loss):
        self._open()
        super().backward(loss)

    def _clip(self):
        params = [p for p in self._inner_module.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)

    def step(self):
        if not self._count_micro_step():
            return False
        self._open()
        if self.max_grad_norm:
            self._clip()
        done = self.optimizer.step()
        self._quorum = False
        if done and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return bool(done)

    def zero_grad(self):
        if self._micro % self.gradient_accumulation_steps == 0:
            self._quorum = False
            self._open()

    @contextlib.contextmanager
    def accumulate(self):
        self._open()
        if self.sync_gradients:
            yield
        else:
            with self.model.no_sync():
                yield

    def unwrap(self):
        return self._inner_module

    @property
    def committed_step(self) -> int:
        return self.replicated.step

    @property
    def data_rank(self) -> int:
        return self.replicated.data_rank      # the replica group (times its ranks, plus the rank)

    @property
    def data_size(self) -> int:
        return self.replicated.data_size

    def summary(self) -> dict:
        return self.replicated.summary()

    def shutdown(self) -> None:
        self.replicated.shutdown()


def prepare_fault_tolerant(model, optimizer, s, **ft_kwargs) -> FaultTolerantPrepared:
    from ..ft import replicated

    model.to(s.device)
    if optimizer is None:
        raise ParallelError("prepare(..., fault_tolerant=True) needs optimizer=: torchft commits optimizer steps")
    shard = _shards(s.strategy)
    if s.dtype is not None:
        model.forward = autocast_forward(model.forward, s.device.type, s.dtype)
    # HSDP: the optimizer is built (or rebound) on the sharded parameters, by ft.replicated; the
    # scheduler then on that optimizer, so it can only be made afterwards
    if shard:
        opt = optimizer if isinstance(optimizer, torch.optim.Optimizer) else \
            (lambda ps: build_optimizer(optimizer, ps))
    else:
        opt = build_optimizer(optimizer, model.parameters())
    state = dict(ft_kwargs.pop("state", None) or {})
    sched = _LateScheduler(s.lr_scheduler) if s.lr_scheduler is not None else None
    if sched is not None:
        state.setdefault("lr_scheduler", sched)
    r = replicated(model, opt, state=state, shard=shard, **ft_kwargs)
    if sched is not None:
        sched = sched.build(r.optimizer.optim)
    return FaultTolerantPrepared(r, s, sched)


class _LateScheduler:
    """The lr scheduler as state for torchft, built once the optimizer is (under HSDP that is inside
    ft.replicated): torchft only calls state_dict/load_state_dict at a step, after it is built."""

    def __init__(self, factory):
        self.factory = factory
        self.inner = None

    def build(self, optimizer):
        self.inner = self.factory(optimizer)
        return self.inner

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, sd):
        self.inner.load_state_dict(sd)
