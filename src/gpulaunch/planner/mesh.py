"""The planner for a device mesh: per-GPU memory and step time of FSDP2 / HSDP / x TP / x CP.

A mesh (``replicate`` x ``shard`` x ``context`` x ``tensor``, as ``gpulaunch.parallel.Mesh``)
changes what one GPU holds and sends:

* states (parameters, gradients, optimizer): divided over shard x context x tensor; replicas
  each hold a full set of shards (HSDP trades memory for inter-node traffic);
* a gathered block: 1/tensor of it (tensor parallelism splits every linear layer);
* activations: each rank computes seq_len / context tokens (context parallelism), and 1/tensor of
  every block's activations (sequence parallelism); the loss's logits stay whole per rank;
* traffic: FSDP's gathers and reduce-scatters over shard x context (within a node when the
  mesh puts replicas across nodes), an all-reduce of the shards across replicas, tensor
  parallelism's all-gathers and reduce-scatters of activations (4 per block each way, exposed:
  the next matmul needs them), and the ring's K/V exchange under context parallelism (hidden
  behind attention when it can be).

Sizes as a dict, an object with those attributes, or ``"replicate=2,shard=4"``. No torch import.
"""
from __future__ import annotations

from dataclasses import replace

from . import memory, timing
from .memory import MemoryBreakdown, Technique
from .shapes import ModelShape
from .training_setup import TrainingSetup

DIMS = ("replicate", "shard", "context", "tensor")


def resolve_mesh(mesh, world: int) -> dict[str, int]:
    """The four sizes, ``shard`` (-1 or missing: what the others leave) worked out for ``world``."""
    if isinstance(mesh, str):
        sizes = {}
        for item in mesh.split(","):
            key, sep, val = item.partition("=")
            if not sep or key.strip() not in DIMS:
                raise ValueError(f"--mesh takes NAME=SIZE pairs of {', '.join(DIMS)}, e.g. replicate=2,shard=4; "
                                 f"got {item!r}")
            try:
                sizes[key.strip()] = int(val)
            except ValueError:
                raise ValueError(f"mesh size {key.strip()}={val!r} is not an integer") from None
    elif isinstance(mesh, dict):
        unknown = sorted(set(mesh) - set(DIMS))
        if unknown:
            raise ValueError(f"mesh has unknown dimension(s) {unknown}; the dimensions are {', '.join(DIMS)}")
        sizes = dict(mesh)
    elif all(hasattr(mesh, d) for d in DIMS):
        sizes = {d: getattr(mesh, d) for d in DIMS}
    else:
        raise ValueError(f"mesh must be a dict of {', '.join(DIMS)} sizes, 'replicate=2,shard=4', or a "
                         f"gpulaunch.parallel.Mesh; got {mesh!r}")
    out = {d: int(sizes.get(d, -1 if d == "shard" else 1)) for d in DIMS}
    for d, v in out.items():
        if v < 1 and not (d == "shard" and v == -1):
            raise ValueError(f"mesh {d}={v}: sizes are >= 1 (shard=-1: what the others leave)")
    others = out["replicate"] * out["context"] * out["tensor"]
    if out["shard"] == -1:
        if world % others:
            raise ValueError(f"mesh {sizes}: replicate x context x tensor = {others} does not divide the "
                             f"{world} GPUs")
        out["shard"] = world // others
    if others * out["shard"] != world:
        raise ValueError(f"mesh {sizes}: replicate x shard x context x tensor = {others * out['shard']}, but "
                         f"the machine has {world} GPUs; the product must equal the GPU count")
    return out


def label(sizes: dict[str, int]) -> str:
    return " x ".join(f"{d} {sizes[d]}" for d in DIMS if sizes[d] > 1) or "one GPU"


def techniques(sizes: dict[str, int]) -> list[str]:
    """What can run this mesh: FSDP2 always (HSDP/TP/CP); DDP when it only replicates; ZeRO when 1-D."""
    names = ["fsdp"]
    if sizes["shard"] == sizes["context"] == sizes["tensor"] == 1:
        names.insert(0, "ddp")
    if sizes["replicate"] == sizes["context"] == sizes["tensor"] == 1:
        names += ["zero1", "zero2", "zero3"]
    return names


def _per_rank(setup: TrainingSetup, sizes) -> TrainingSetup:
    if setup.seq_len % sizes["context"]:
        raise ValueError(f"seq_len {setup.seq_len} is not divisible by context={sizes['context']}")
    return replace(setup, seq_len=setup.seq_len // sizes["context"])


def estimate(shape: ModelShape, setup: TrainingSetup, tech: Technique, sizes: dict[str, int]) -> MemoryBreakdown:
    if tech.name == "ddp":
        return memory.estimate(shape, setup, tech, sizes["replicate"])
    split = sizes["shard"] * sizes["context"] * sizes["tensor"]
    return memory.estimate(shape, _per_rank(setup, sizes), tech, split, tensor=sizes["tensor"])


def step_seconds(shape: ModelShape, setup: TrainingSetup, tech: Technique, sizes: dict[str, int],
                 gpus_per_node: int, nodes: int, gpu) -> float:
    """One step of one data-parallel rank's micro-batch, shared by its tensor x context GPUs."""
    R, S, C, T = (sizes[d] for d in DIMS)
    if tech.name != "fsdp":
        return timing.step_seconds(shape, setup, tech, R * S, nodes, gpu)
    compute = timing.flops_per_step(shape, setup) / (T * C) / (gpu.bf16_tflops * 1e12 * timing.MODEL_FLOPS_UTILIZATION)
    intra, inter = gpu.intra_node_gbps * 1e9, gpu.inter_node_gbps * 1e9
    inner = S * C * T            # ranks of one replica, laid out innermost
    c = setup.compute_bytes
    P = shape.total_params
    fsdp_link = intra if inner <= gpus_per_node else inter
    fsdp = (S * C - 1) / max(1, S * C) * (2 * c + 4) * P / T / fsdp_link if S * C > 1 else 0.0
    hsdp = 2 * (R - 1) / R * 4 * P / inner / (inter if nodes > 1 else intra) if R > 1 else 0.0
    tokens = setup.tokens // C
    tp_link = intra if T <= gpus_per_node else inter
    tp = 8 * (T - 1) / T * tokens * shape.hidden_size * c * shape.num_layers / tp_link if T > 1 else 0.0
    cp = 3 * (C - 1) * (tokens * 2 * shape.kv_dim * c) * shape.num_layers / intra if C > 1 else 0.0
    hidden = timing.OVERLAP * compute
    exposed = max(0.0, fsdp + hsdp + cp - hidden) + tp
    off = 0.0
    if tech.offload:
        share = P / inner
        off = 4 * c * share / (gpu.host_link_gbps * 1e9) + share / timing.CPU_ADAM_PARAMS_PER_S
    return compute + exposed + off
