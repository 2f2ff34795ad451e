"""FSDP2 behind ``prepare(strategy="fsdp")``: ``fully_shard`` per block, then the root.

The mesh it shards over comes from :class:`gpulaunch.parallel.mesh.BuiltMesh`: 1-D (FSDP over
shard x context), or 2-D replicate x shard (HSDP: reduce-scatter within a shard group, all-reduce
across replicas). Parameters that tensor parallelism already split are DTensors on the tensor
mesh; ``fully_shard`` shards them further (FSDP2 x TP, 2-D or 3-D with HSDP).
"""

from __future__ import annotations

import inspect
import warnings

import torch

from . import _env
from ._env import ParallelError
from ._optim import build_optimizer, param_names
from .compile import compile_in_place

__all__ = ["apply_fsdp"]


def apply_fsdp(model, optimizer, device, dtype, cpu_offload, blist, fsdp_kwargs, mesh=None, compile_opts=None):
    """Shard ``model`` over ``mesh`` (a torch DeviceMesh; default: every rank, 1-D), compiling each
    block before it is sharded and the root after. Returns (model, optimizer)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    # Record which param (by name) sat in which group before sharding replaces the Parameter objects.
    rebuild_groups = None
    if isinstance(optimizer, torch.optim.Optimizer):
        names = param_names(model)
        rebuild_groups = [({k: v for k, v in g.items() if k != "params"}, [names[id(p)] for p in g["params"]])
                          for g in optimizer.param_groups]
        if len(optimizer.state):
            raise ParallelError("the optimizer passed to prepare(strategy='fsdp') already has state (it "
                                "stepped); FSDP2 replaces the parameters, so that state would be lost. "
                                "Pass a factory `lambda params: Opt(params, ...)` instead.")

    if not cpu_offload:
        model.to(device)
    fsdp_kwargs = dict(fsdp_kwargs)
    mesh = mesh or fsdp_kwargs.pop("mesh", None) or init_device_mesh(device.type, (_env.world_size(),))
    if compile_opts is not None:
        for block in blist:
            compile_in_place(block, compile_opts)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
    kw = {"mesh": mesh, "mp_policy": mp, "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy()}
    kw.update(fsdp_kwargs)
    # The last block is needed again right away in backward: keep it unsharded after forward.
    # On one rank resharding frees only the bf16 copy of a block's weights and costs a second
    # cast ("all-gather") per block in backward, so keep every block unsharded there, unless the
    # parameters are offloaded to the CPU to save GPU memory.
    keep_all = _env.world_size() == 1 and not cpu_offload
    for i, block in enumerate(blist):
        fully_shard(block, **{"reshard_after_forward": not keep_all and i < len(blist) - 1, **kw})
    fully_shard(model, **kw)
    if compile_opts is not None:   # the root's own code: embedding, head, loss
        compile_in_place(model, compile_opts)

    if rebuild_groups is not None:
        warnings.warn(
            f"prepare(strategy='fsdp') got an already-built {type(optimizer).__name__}; FSDP2 replaced the "
            "model's parameters with sharded ones, so it was rebuilt on them with the same param groups "
            "(an optimizer on the old parameters would never train). Pass a factory instead: "
            "`optimizer=lambda params: torch.optim.AdamW(params, ...)`.", stacklevel=3)
        params = dict(model.named_parameters())
        groups = [{**hp, "params": [params[n] for n in ns]} for hp, ns in rebuild_groups]
        accepted = inspect.signature(type(optimizer).__init__).parameters
        opt = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
    else:
        opt = build_optimizer(optimizer, model.parameters())
    return model, opt
