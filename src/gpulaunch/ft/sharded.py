"""HSDP under torchft: FSDP2 shards the model over the ranks of one replica group, torchft
replicates the shards across groups (``ft.replicated(model, opt, shard=True)``).

Inside a group, ``fully_shard`` runs over the group's own process group (the one every
gpulaunch launch sets up): the all-gather before a layer and the reduce-scatter of its
gradient never leave the group. Across groups, FSDP2's all-reduce hook (the extension point
its own HSDP uses for the replicate dimension) hands each reduce-scattered gradient shard to
torchft's ``Manager.allreduce``. The Manager's process group is per group rank (torchft
prefixes its store with the group rank), so rank k of every group averages shard k with rank
k of the others, and a group that dies mid-all-reduce only makes the step fail (dropped by
every group's commit vote), never the survivors.

A replacement group heals shard by shard: torchft asks the healing source for the checkpoint
of the same group rank, so each rank sends and receives its own shards only. The state sent is
plain local tensors (a DTensor carries its mesh, which means nothing in another group); they
are put back under the receiving rank's own DTensor layout.
"""

from __future__ import annotations

import contextlib
from typing import Any

from ..errors import ConfigurationError


def check_layout(group_size: int, shard: bool) -> None:
    """A group of several ranks must shard: torchft's DDP replicates one rank per group, and
    plain DDP inside a group would need a second replication layer nobody heals."""
    if group_size > 1 and not shard:
        raise ConfigurationError(
            f"this replica group has {group_size} ranks: pass ft.replicated(..., shard=True) "
            "(FSDP2 inside the group, torchft across groups; prepare(..., fault_tolerant=True, "
            "strategy='fsdp')), or start one rank per group (run_replicas(ranks_per_group=1)).")


def rebind_optimizer(optimizer, before: list, after: list):
    """Point a built optimizer at the sharded parameters. ``fully_shard`` replaces each
    parameter by a new DTensor one (same order), so an optimizer built before it would step
    tensors nobody uses. Its state must be empty: a step's state is per full tensor."""
    if len(before) != len(after):
        raise ConfigurationError("ft.replicated(shard=True): the model's parameters changed "
                                 "in number when sharded")
    if any(optimizer.state.get(p) for p in before):
        raise ConfigurationError(
            "ft.replicated(shard=True) takes an optimizer that has not stepped yet (or a "
            "factory, lambda params: torch.optim.AdamW(params, ...)): its state would be for "
            "the unsharded parameters")
    new = {id(b): a for b, a in zip(before, after)}
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in new]
        if missing:
            raise ConfigurationError("ft.replicated(shard=True): the optimizer holds "
                                     f"{len(missing)} tensor(s) that are not the model's")
        group["params"] = [new[id(p)] for p in group["params"]]
    return optimizer


def shard_in_group(model, optimizer):
    """``fully_shard`` ``model`` over this group's ranks; returns (model, optimizer) where the
    optimizer is built by ``optimizer(params)`` (a factory) or is the built one rebound."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("shard",))
    before = list(model.parameters())
    fully_shard(model, mesh=mesh)
    after = list(model.parameters())
    if isinstance(optimizer, torch.optim.Optimizer):
        return model, rebind_optimizer(optimizer, before, after)
    built = optimizer(after)
    if not isinstance(built, torch.optim.Optimizer):
        raise ConfigurationError(f"the optimizer factory returned {type(built).__name__}, "
                                 "not a torch.optim.Optimizer")
    return model, built


def _local(value):
    """A state value as this rank's own tensors: DTensors become their local shard."""
    from torch.distributed.tensor import DTensor
    if isinstance(value, DTensor):
        return value.to_local().detach().clone()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_local(v) for v in value)
    return value


def sharded_params(model) -> dict:
    """The model's sharded parameters, by name. Taken once, right after ``fully_shard``: torchft
    reads the state to send from its quorum thread, which can run while the main thread is in
    a forward, and there FSDP2 has swapped the unsharded tensors into the module (a
    ``named_parameters()`` then gives full tensors, not this rank's shards)."""
    return dict(model.named_parameters())


def local_state(model, params: dict, optimizer) -> dict:
    """What this rank sends to the same rank of a healing group: its shards only (copies: the
    transport serves them later, after this rank may have stepped)."""
    return {"model": {n: _local(p) for n, p in params.items()},
            "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
            "optim": _local(optimizer.state_dict())}


def load_local_state(model, params: dict, optimizer, sd: dict) -> None:
    """Inverse of :func:`local_state` on the receiving rank: the shards are copied into the
    parameters' local tensors, and the optimizer's per-parameter state is put back under
    each parameter's DTensor layout (it arrives as plain tensors)."""
    import torch
    from torch.distributed.tensor import DTensor

    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name, t in sd["model"].items():
            p = params[name]
            (p.to_local() if isinstance(p, DTensor) else p).copy_(t)
        for name, t in sd["buffers"].items():
            buffers[name].copy_(t)
    optimizer.load_state_dict(sd["optim"])
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor):
                continue
            state = optimizer.state.get(p, {})
            local_shape = p.to_local().shape
            for key, value in list(state.items()):
                # per-element state (Adam's moments) has the shard's shape; "step" is a scalar
                if (isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
                        and value.dim() > 0 and value.shape == local_shape):
                    state[key] = DTensor.from_local(value, p.device_mesh, p.placements,
                                                    run_check=False, shape=p.shape,
                                                    stride=p.stride())


def sharded_replica(manager, module):
    """The sharded model as ``Replicated.model`` (built here: torch is imported lazily)."""
    import torch

    class ShardedReplica(torch.nn.Module):
        """Call it as the model; ``module`` is the FSDP2 module (``unwrap``); ``no_sync()``
        holds back both the in-group reduce-scatter and the cross-group all-reduce for
        gradient accumulation (as DDP's ``no_sync``)."""

        def __init__(self):
            super().__init__()
            self.module = module
            self.manager = manager
            module.set_all_reduce_hook(self._across_groups)

        def _across_groups(self, shard_grad) -> None:
            # torchft averages over the live groups (zeroing a healing group's share); an
            # error is recorded by the manager, which then votes the step down everywhere
            self.manager.allreduce(shard_grad).wait()

        def forward(self, *args, **kwargs) -> Any:
            return self.module(*args, **kwargs)

        @contextlib.contextmanager
        def no_sync(self):
            self.module.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.module.set_requires_gradient_sync(True)

    return ShardedReplica()
