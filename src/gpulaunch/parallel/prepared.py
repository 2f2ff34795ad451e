"""What ``prepare()`` returns: one training-loop API (backward, step, zero_grad, accumulate)
whatever the strategy underneath."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ._env import ParallelError

__all__ = ["DeepSpeedPrepared", "Prepared", "TorchPrepared"]


class Prepared:
    """A model and optimizer made ready for one strategy, with a loop API that works for all.

    Attributes: ``model`` (call it for forward), ``optimizer``, ``strategy``, ``device``,
    ``mixed_precision``, ``gradient_accumulation_steps``, ``lr_scheduler``.
    """

    strategy: str
    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    lr_scheduler: Any = None
    mesh: Any = None   # a parallel.mesh.BuiltMesh, or None (no mesh: one flat world)

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self) -> bool:
        """Optimizer step on an accumulation boundary (returns True then), else only counts."""
        raise NotImplementedError

    def zero_grad(self) -> None:
        raise NotImplementedError

    def accumulate(self):
        """Context for one micro-batch's forward+backward; skips gradient sync unless it is the last."""
        raise NotImplementedError

    def unwrap(self) -> nn.Module:
        """The user's own module (under FSDP2 / ZeRO-3 its parameters are sharded)."""
        raise NotImplementedError

    @property
    def data_rank(self) -> int:
        """Which batch this rank reads: its index among the data-parallel (replicate x shard) ranks.
        The ranks of one tensor- or context-parallel group read the same batch."""
        if self.mesh is not None:
            return self.mesh.data_rank
        from . import _env
        return _env.rank() if self.strategy != "none" else 0

    @property
    def data_size(self) -> int:
        """How many different batches one step reads (the data-parallel world size)."""
        if self.mesh is not None:
            return self.mesh.data_size
        from . import _env
        return _env.world_size() if self.strategy != "none" else 1

    def context_parallel(self, *buffers, seq_dims=None):
        """Context manager: shard the sequence tensors (inputs, labels, positions) over the mesh's
        context ranks for one forward and backward (:mod:`gpulaunch.parallel.context_parallel`)."""
        if self.mesh is None or self.mesh.spec.context == 1:
            raise ParallelError("context_parallel() needs prepare(..., mesh=Mesh(context=N)) with N > 1")
        from .context_parallel import context_parallel
        return context_parallel(self.mesh.context, buffers, seq_dims)

    @property
    def sync_gradients(self) -> bool:
        """True when the next ``step()`` is an accumulation boundary."""
        return (self._micro + 1) % self.gradient_accumulation_steps == 0

    def __repr__(self):
        mesh = f", mesh={self.mesh.spec}" if self.mesh is not None else ""
        return (f"Prepared(strategy={self.strategy!r}{mesh}, device={self.device}, "
                f"mixed_precision={self.mixed_precision!r}, "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps})")


class TorchPrepared(Prepared):
    """``none``, ``ddp`` and ``fsdp``: plain torch optimizer, our own accumulation and loss scaling."""

    def __init__(self, strategy, model, optimizer, device, mixed_precision, gas, max_grad_norm,
                 lr_scheduler, scaler, inner, after_step: list[Callable[[], Any]] | None = None, mesh=None):
        self.strategy, self.model, self.optimizer, self.device = strategy, model, optimizer, device
        self.mesh = mesh   # a parallel.mesh.BuiltMesh, or None (no mesh: one flat world)
        self.mixed_precision, self.gradient_accumulation_steps = mixed_precision, gas
        self.max_grad_norm, self.lr_scheduler, self.scaler, self._inner = max_grad_norm, lr_scheduler, scaler, inner
        self._micro = 0
        # run after each optimizer step (e.g. fp8 under FSDP2: precompute the next all-gather's scales)
        self._after_step = list(after_step or [])

    def backward(self, loss):
        if self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def _clip(self):
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.strategy == "fsdp":   # sharded (and tensor-parallel) gradients are DTensors
            from torch.distributed.tensor import DTensor

            total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
            if isinstance(total, DTensor):
                total = total.full_tensor()
            torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, total)
            return total
        return torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)


    def _count_micro_step(self) -> bool:
        """Count one micro-batch; True when it ends an accumulation window (the optimizer steps
        now). Shared with the torchft variant (``fault_tolerant.py``)."""
        if self.optimizer is None:
            raise ParallelError("prepare() was called without an optimizer; pass optimizer= to train")
        self._micro += 1
        return self._micro % self.gradient_accumulation_steps == 0

    def step(self):
        if not self._count_micro_step():
            return False
        if self.scaler is not None:
            if self.max_grad_norm:
                self.scaler.unscale_(self.optimizer)
                self._clip()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            if self.max_grad_norm:
                self._clip()
            self.optimizer.step()
        for fn in self._after_step:
            fn()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return True

    def zero_grad(self):
        if self.optimizer is not None and self._micro % self.gradient_accumulation_steps == 0:
            self.optimizer.zero_grad(set_to_none=True)

    @contextlib.contextmanager
    def accumulate(self):
        sync = self.sync_gradients
        if sync or self.strategy == "none":
            yield
        elif self.strategy == "ddp":
            with self.model.no_sync():
                yield
        elif not hasattr(self.model, "set_requires_gradient_sync"):
            yield   # tensor parallel only: no data-parallel gradient sync to skip
        else:  # fsdp: keep unsharded grads locally, reduce-scatter on the last micro-batch
            self.model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.model.set_requires_gradient_sync(True)

    def unwrap(self):
        return self._inner


class DeepSpeedPrepared(Prepared):
    """``zero1``/``zero2``/``zero3``: DeepSpeed's engine owns backward, step and accumulation."""

    def __init__(self, strategy, engine, device, mixed_precision, gas, config):
        self.strategy, self.engine, self.model, self.device = strategy, engine, engine, device
        self.optimizer, self.lr_scheduler = engine.optimizer, engine.lr_scheduler
        self.mixed_precision, self.gradient_accumulation_steps, self.config = mixed_precision, gas, config

    @property
    def _micro(self):
        return self.engine.micro_steps

    def backward(self, loss):
        self.engine.backward(loss)  # scales by 1/gradient_accumulation_steps itself

    def step(self):
        boundary = self.engine.is_gradient_accumulation_boundary()
        self.engine.step()
        return boundary

    def zero_grad(self):
        pass  # the engine zeroes gradients after each optimizer step

    @contextlib.contextmanager
    def accumulate(self):
        yield  # the engine reduces gradients only on the boundary by itself

    def unwrap(self):
        return self.engine.module
