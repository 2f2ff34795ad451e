"""The device mesh: how the world's ranks split into replicate x shard x context x tensor groups.

``prepare(..., mesh=Mesh(...))`` describes a job's parallelism in one object, as torchtitan's
``ParallelDims`` does, instead of one strategy name per combination::

    Mesh(shard=8)                       FSDP2 over 8 ranks (the default for strategy="fsdp")
    Mesh(replicate=2, shard=4)          HSDP: shard within a node of 4, replicate across 2 nodes
    Mesh(shard=4, tensor=2)             FSDP2 x tensor parallel (TP inside a pair of GPUs)
    Mesh(shard=2, context=4)            FSDP2 x context parallel (long sequences)

The four sizes multiply to the world size; ``shard=-1`` (the default) takes whatever the other
three leave. Ranks are laid out with ``tensor`` innermost (neighbouring ranks, the fastest links,
share a tensor-parallel group), then ``context``, ``shard``, ``replicate`` outermost (across
nodes), the order torchtitan uses. Data-parallel ranks (replicate x shard) each read their own
batch; the ranks of one tensor- or context-parallel group read the same one
(:attr:`BuiltMesh.data_rank`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from ._env import ParallelError

__all__ = ["DIMS", "BuiltMesh", "Mesh", "as_mesh"]

# outermost first: the layout of ranks in the mesh (tensor-parallel neighbours share a node's links)
DIMS = ("replicate", "shard", "context", "tensor")


@dataclass(frozen=True)
class Mesh:
    """Sizes of the four parallel dimensions; their product is the world size.

    Attributes:
        replicate: copies of the (sharded) model; gradients are all-reduced across them. With
            ``shard > 1`` this is HSDP (hybrid sharding); alone it is plain data parallelism.
        shard: ranks one FSDP2 group shards parameters, gradients and optimizer state over.
            ``-1``: the world size divided by the other three.
        context: ranks that split each sequence (context parallel, ring attention); they also
            take part in sharding, as in torchtitan.
        tensor: ranks that split each linear layer (tensor parallel, Megatron-style).
    """

    replicate: int = 1
    shard: int = -1
    context: int = 1
    tensor: int = 1

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ParallelError(f"Mesh({f.name}=...) takes an int, got {v!r}")
            if v < 1 and not (f.name == "shard" and v == -1):
                raise ParallelError(f"Mesh({f.name}={v}): sizes are >= 1"
                                    + (" (shard=-1 means: whatever the others leave)" if f.name == "shard" else ""))

    def resolve(self, world_size: int) -> Mesh:
        """This mesh with ``shard`` worked out for ``world_size``; raises when the sizes cannot fill it."""
        others = self.replicate * self.context * self.tensor
        if self.shard == -1:
            if world_size % others:
                raise ParallelError(
                    f"{self} cannot fill a world of {world_size} ranks: replicate x context x tensor = "
                    f"{others} does not divide {world_size}. Pick sizes whose product divides the world size.")
            return Mesh(self.replicate, world_size // others, self.context, self.tensor)
        if others * self.shard != world_size:
            raise ParallelError(
                f"{self}: replicate x shard x context x tensor = {others * self.shard}, but the world "
                f"has {world_size} ranks. The product must equal the world size (or pass shard=-1 to "
                f"let it take what is left).")
        return self

    @property
    def sizes(self) -> dict[str, int]:
        return {d: getattr(self, d) for d in DIMS}

    @property
    def size(self) -> int:
        """The world size this mesh fills (after :meth:`resolve`)."""
        return math.prod(self.sizes.values())

    @property
    def data_parallel(self) -> int:
        """Ranks that each read a different batch: replicate x shard."""
        return self.replicate * self.shard

    def is_one_dimensional(self) -> bool:
        return sum(1 for v in self.sizes.values() if v > 1) <= 1 and self.context == 1 and self.tensor == 1

    def __str__(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in self.sizes.items() if v != 1 or k == "shard")
        return f"Mesh({inner})"

    def build(self, device_type: str) -> BuiltMesh:
        """The torch ``DeviceMesh`` over the current process group (every rank must call it)."""
        from . import _env
        resolved = self.resolve(_env.world_size())
        return BuiltMesh(resolved, device_type)


def as_mesh(mesh) -> Mesh | None:
    """``prepare(mesh=...)`` accepts a :class:`Mesh`, a dict of its sizes, or None."""
    if mesh is None or isinstance(mesh, Mesh):
        return mesh
    if isinstance(mesh, dict):
        unknown = sorted(set(mesh) - set(DIMS))
        if unknown:
            raise ParallelError(f"mesh= got unknown dimension(s) {unknown}; the dimensions are {', '.join(DIMS)}")
        return Mesh(**mesh)
    raise ParallelError(f"mesh= takes gpulaunch.parallel.Mesh(replicate=, shard=, context=, tensor=) or a dict "
                        f"of those sizes, got {type(mesh).__name__}")


class BuiltMesh:
    """A :class:`Mesh` made real: one torch ``DeviceMesh`` with every dimension named (size-1 ones
    too, so that each strategy asks for the same names whatever the sizes), and the sub-meshes the
    strategies use."""

    def __init__(self, mesh: Mesh, device_type: str):
        from torch.distributed.device_mesh import init_device_mesh

        self.spec = mesh
        self.device_type = device_type
        self.device_mesh = init_device_mesh(device_type, tuple(mesh.sizes.values()), mesh_dim_names=DIMS)
        # FSDP shards over shard x context (torchtitan's dp_shard_cp): the context ranks hold the
        # same parameters, so they may as well hold a share of them each.
        # (the flattened meshes are kept here: torch deprecates slicing them out of the root again)
        self._shard_context = (self.device_mesh["shard", "context"]._flatten("shard_context")
                               if mesh.context > 1 else None)
        # the data-parallel ranks (each reads its own batch), for loaders and the loss's mean
        self._data = self.device_mesh["replicate", "shard"]._flatten("data")

    def __getitem__(self, names):
        return self.device_mesh[names]

    @property
    def fsdp(self):
        """The mesh FSDP2 shards over: 1-D (FSDP), or 2-D replicate x shard (HSDP)."""
        if self.spec.replicate > 1:   # HSDP (x CP: a slice of the flattened dim, as torchtitan's dp_shard_cp)
            return self.device_mesh["replicate", "shard_context" if self.spec.context > 1 else "shard"]
        return self._shard_context if self.spec.context > 1 else self.device_mesh["shard"]

    @property
    def tensor(self):
        return self.device_mesh["tensor"]

    @property
    def context(self):
        return self.device_mesh["context"]

    @property
    def data(self):
        return self._data

    @property
    def data_rank(self) -> int:
        """Which batch this rank reads: its index among the replicate x shard ranks."""
        return self.data.get_local_rank()

    @property
    def data_size(self) -> int:
        return self.spec.data_parallel

    def coordinates(self) -> dict[str, int]:
        return {d: self.device_mesh[d].get_local_rank() for d in DIMS}

    def __repr__(self):
        return f"BuiltMesh({self.spec}, {self.device_type})"
