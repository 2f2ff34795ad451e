"""Context parallelism: each sequence split across the ``context`` ranks, attention as a ring.

With ``prepare(..., mesh=Mesh(context=C, ...))`` every rank of a context group holds 1/C of each
sequence (reordered head-and-tail so that causal attention costs each rank the same), and the
scaled-dot-product attention exchanges keys and values around the ring (torch's experimental
``context_parallel``). Activation memory per rank drops C-fold, which is what makes sequences of
hundreds of thousands of tokens trainable. The context ranks also share FSDP2's sharding.

The training loop marks where the sequences are sharded::

    p = prepare(model, opt, strategy="fsdp", mesh=Mesh(context=2))
    positions = torch.arange(seq_len, device=p.device)
    with p.context_parallel(tokens, targets, positions):   # sharded in place, restored after
        loss = p.model(tokens, targets, positions=positions)
        p.backward(loss)
    p.step()

Every tensor whose size depends on the sequence goes in (inputs, labels, positions); the model
must take the positions (RoPE) rather than assume ``0..T-1``, as the reference model does.

CUDA only: torch's ring attention replaces the CUDA SDPA kernels (flash, memory-efficient,
cuDNN); the CPU kernel has no ring version, so prepare() refuses a context mesh on CPU.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ._env import ParallelError

__all__ = ["check_context_parallel", "context_parallel", "prepare_model"]


def check_context_parallel(device: torch.device, context: int) -> None:
    if context > 1 and device.type != "cuda":
        raise ParallelError(
            f"Mesh(context={context}) needs CUDA GPUs: context parallelism runs attention as a ring through "
            "torch's CUDA SDPA kernels (flash, memory-efficient, cuDNN), and the CPU SDPA kernel has no ring "
            f"version, so it cannot run on {device}. Use Mesh(context=1) here (shard or tensor instead).")


def prepare_model(model: nn.Module) -> None:
    """What the model needs under context parallelism: the reference model copies K/V heads for
    grouped-query attention itself (the ring kernels take no ``enable_gqa``)."""
    from .reference_model import Attention
    for m in model.modules():
        if isinstance(m, Attention):
            m.expand_kv = True


@contextlib.contextmanager
def context_parallel(context_mesh, buffers, seq_dims=None):
    """Shard ``buffers`` along their sequence dimension (default: 1 for 2-D+ tensors, 0 for 1-D)
    over ``context_mesh`` for the duration, with attention running as a ring."""
    try:
        from torch.distributed.tensor.experimental import context_parallel as torch_cp
    except ImportError as e:   # pragma: no cover - torch < 2.6
        raise ParallelError(f"context parallelism needs torch >= 2.6 (torch.distributed.tensor.experimental"
                            f".context_parallel): {e}") from e
    buffers = list(buffers)
    if not buffers or not all(isinstance(b, torch.Tensor) for b in buffers):
        raise ParallelError("context_parallel() takes the sequence tensors to shard: inputs, labels, positions")
    if seq_dims is None:
        seq_dims = [0 if b.dim() == 1 else 1 for b in buffers]
    if len(seq_dims) != len(buffers):
        raise ParallelError(f"seq_dims= has {len(seq_dims)} entries for {len(buffers)} buffers")
    size = context_mesh.size()
    for b, d in zip(buffers, seq_dims):
        if b.shape[d] % (2 * size):
            raise ParallelError(f"a sequence of {b.shape[d]} cannot be split head-and-tail over {size} context "
                                f"ranks: its length must be a multiple of 2 x context = {2 * size}")
    with torch_cp(context_mesh, buffers=buffers, buffer_seq_dims=list(seq_dims)):
        yield
