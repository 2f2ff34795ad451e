"""Activation checkpointing per block: full (recompute everything) or selective (recompute the cheap).

``prepare(activation_checkpointing=...)``:

* ``True`` or ``"full"``: each block keeps only its input; backward runs the block's forward again.
  Least memory, about one extra forward of compute (~+33% of a step's FLOPs).
* ``"selective"``: torchtitan's op-level policy. Backward recomputes the element-wise work (norms,
  activations, RoPE, residual adds) but keeps the outputs of the costly ops: attention, and every
  other matmul (half of them, so the saved memory is still about half of what full AC saves),
  plus reductions' results and reduce-scatters under tensor parallelism. Most of full AC's memory
  saving for a fraction of its recompute.

The blocks' ``forward`` is wrapped in place (no wrapper module), so parameter names, hence
checkpoints, do not change. Applied after tensor parallelism and before compilation and FSDP2.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from ._env import ParallelError

__all__ = ["AC_MODES", "apply_activation_checkpointing", "ac_mode"]

AC_MODES = ("full", "selective")


def ac_mode(value) -> str | None:
    """``prepare(activation_checkpointing=...)`` as None, "full" or "selective"."""
    if value is None or value is False:
        return None
    if value is True:
        return "full"
    if isinstance(value, str) and value.lower() in AC_MODES:
        return value.lower()
    raise ParallelError(f"activation_checkpointing= takes True/'full', 'selective' or False, got {value!r}")


def _saved_ops() -> set:
    aten = torch.ops.aten
    names = ["mm.default", "_scaled_dot_product_efficient_attention.default",
             "_scaled_dot_product_flash_attention.default", "_scaled_dot_product_cudnn_attention.default",
             "_scaled_dot_product_flash_attention_for_cpu.default", "_scaled_mm.default", "max.default"]
    ops = set()
    for n in names:
        packet, _, overload = n.partition(".")
        if hasattr(aten, packet):
            ops.add(getattr(getattr(aten, packet), overload))
    c10d = getattr(torch.ops, "_c10d_functional", None)
    if c10d is not None and hasattr(c10d, "reduce_scatter_tensor"):
        ops.add(c10d.reduce_scatter_tensor.default)
    return ops


def _selective_context():
    """A fresh (forward, recompute) context pair per checkpointed call: the policy counts matmuls
    in each pass separately so that forward and recompute agree on which ones were saved."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = _saved_ops()
    mm = torch.ops.aten.mm.default
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func is mm:
            counts[mode] += 1
            if counts[mode] % 2 == 0:    # every second matmul is recomputed
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_activation_checkpointing(blocks: list[nn.Module], mode: str | bool = "full") -> None:
    """Checkpoint each block's forward (non-reentrant ``torch.utils.checkpoint``), in place."""
    from torch.utils.checkpoint import checkpoint

    mode = ac_mode(mode)
    if mode is None:
        return
    if not blocks:
        raise ParallelError("activation_checkpointing= needs repeated blocks and none were found; pass blocks=")
    extra = {"context_fn": _selective_context} if mode == "selective" else {}
    for block in blocks:
        inner = block.forward  # bound method; the instance attribute below shadows the class's forward

        def ckpt_forward(*args, __inner=inner, **kwargs):
            return checkpoint(__inner, *args, use_reentrant=False, **extra, **kwargs)

        block.forward = ckpt_forward
