"""``strategy="auto"``: the planner's choice for this model, world and device memory.

With a mesh the layout is the user's: replicate-only meshes are DDP, anything that shards,
splits tensors or sequences is FSDP2 (HSDP when it replicates too). Without one the planner
(``gpulaunch.planner``) picks the fastest technique that fits; when it is not importable a
parameter-count estimate decides between DDP and FSDP2.
"""

from __future__ import annotations

import os

from torch import nn

from . import _env
from .mesh import Mesh

__all__ = ["choose", "estimate_training_bytes", "strategy_for_mesh"]


def estimate_training_bytes(model: nn.Module, mixed_precision: str | None = None,
                            optimizer_states: int = 2) -> int:
    """Bytes one unsharded replica needs for params + grads + Adam-like states (activations excluded).

    fp32: 4 (param) + 4 (grad) + 4*optimizer_states; bf16/fp16 autocast keeps fp32 master params,
    so the same, and activations shrink instead.
    """
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return n * (4 + 4 + 4 * optimizer_states) + frozen * 4


def strategy_for_mesh(mesh: Mesh) -> tuple[str, str]:
    m = mesh
    if m.shard in (1, -1) and m.context == 1 and m.tensor == 1 and m.replicate > 1:
        return "ddp", f"{m} only replicates: DDP"
    return "fsdp", f"{m} shards or splits: FSDP2" + (" (HSDP: replicated shards)" if m.replicate > 1 else "")


def choose(model: nn.Module, device, mixed_precision, device_memory: int, **planner_kwargs) -> tuple[str, str]:
    world = _env.world_size()
    strategy, reason, offload_only = _by_memory(model, device, mixed_precision, world, device_memory,
                                                **planner_kwargs)
    if world == 1 and not offload_only:
        # One rank has nobody to replicate to or shard across: DDP, FSDP2 and ZeRO would only add
        # hooks and copies (measured: FSDP2 at world size 1 is 0.93x the plain loop compiled).
        # A sharded choice stays only where nothing fits without CPU offload, which needs it.
        tight = "" if strategy == "ddp" else (
            " -- it may not fit: consider activation_checkpointing=True, or strategy='fsdp' with "
            "cpu_offload=True")
        return "none", (f"world size 1: plain training without a wrapper (DDP, FSDP2 or ZeRO would "
                        f"only add hooks and copies on one rank){tight}; memory: {reason}")
    return strategy, reason


def _by_memory(model, device, mixed_precision, world, have, **planner_kwargs) -> tuple[str, str, bool]:
    """(strategy, reason, whether it fits only with CPU offload)."""
    from gpulaunch.planner import choose_strategy  # ours: a failure here is a bug to see

    from .settings import normalize_strategy
    # ranks per node: the launcher's LOCAL_WORLD_SIZE, else (a group built by hand) one node
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    precision = {None: "fp32", "no": "fp32", "fp32": "fp32"}.get(mixed_precision, mixed_precision)
    offered = dict(gpus_per_node=local, nodes=max(1, world // max(1, local)),
                   gpu_memory_bytes=have, precision=precision, **planner_kwargs)
    strategy, reason = choose_strategy(model, **offered)
    base, _, offload = strategy.partition("+")   # "+offload": prepare(cpu_offload=True) is the user's call
    return normalize_strategy(base), f"planner: {reason}", bool(offload)
