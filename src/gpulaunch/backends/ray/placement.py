"""Decide how a job lies on the cluster's nodes, refuse what can never fit, reserve the rest.

One node agent per node, so the job is a placement group of ``nnodes`` identical bundles with
``STRICT_SPREAD`` (each on a different node): all nodes or none, never a partial start that
waits on a collective. A bundle holds its node's GPUs (``{"GPU": 8}``, plus the accelerator
type's resource when ``gpu_type`` is asked), or on a cluster without GPUs one CPU per rank.

A job that the cluster, as it is, can never hold is refused at once, naming what is missing:
Ray itself would wait forever for an infeasible placement group.
"""

from __future__ import annotations

import dataclasses
import os
import time

from ...errors import GPUTypeError, GPUValidationError, LaunchError
from ...hardware.catalog import GPUType, gpu_type_from_device_name

ACCEL_PREFIX = "accelerator_type:"


@dataclasses.dataclass(frozen=True)
class NodeView:
    """What one alive Ray node offers (totals, not what is free now)."""

    node_id: str
    ip: str
    cpus: int
    gpus: int
    gpu_types: tuple[str, ...]          # Ray's accelerator names on it, e.g. ("H100",)

    def describe(self, device: str) -> str:
        if device == "cuda":
            kind = "/".join(self.gpu_types) or "GPU"
            return f"{self.gpus} x {kind}" if self.gpus else "no GPU"
        return f"{self.cpus} CPU"


@dataclasses.dataclass(frozen=True)
class Layout:
    """The job's shape on the cluster."""

    device: str                         # "cuda" or "cpu"
    nnodes: int
    nproc_per_node: int
    bundle: dict                        # resources of one node's bundle
    accel_resource: str | None = None   # e.g. "accelerator_type:H100"

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def actor_options(self) -> dict:
        """Resources the node agent actor takes from its bundle: all of it, so Ray assigns
        the bundle's GPUs to it (CUDA_VISIBLE_DEVICES) and its ranks inherit them."""
        if self.device == "cuda":
            opts = {"num_cpus": 0, "num_gpus": self.nproc_per_node}
            if self.accel_resource:
                opts["resources"] = {self.accel_resource: self.bundle[self.accel_resource]}
            return opts
        return {"num_cpus": self.nproc_per_node, "num_gpus": 0}

    def probe_resources(self) -> dict:
        """A sliver of one bundle (a restart checks that each bundle's node is alive)."""
        if self.device == "cuda":
            return {"num_cpus": 0, "num_gpus": 0.01}
        return {"num_cpus": 0.01}

    def describe(self) -> str:
        unit = "GPU" if self.device == "cuda" else "CPU slot"
        return (f"{self.nnodes} node(s) x {self.nproc_per_node} {unit}(s) = "
                f"{self.world_size} rank(s)")


def cluster_nodes(ray) -> list[NodeView]:
    out = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = n.get("Resources") or {}
        types = tuple(sorted(k[len(ACCEL_PREFIX):] for k in res if k.startswith(ACCEL_PREFIX)))
        out.append(NodeView(node_id=n["NodeID"], ip=n.get("NodeManagerAddress", "?"),
                            cpus=int(res.get("CPU", 0)), gpus=int(res.get("GPU", 0)),
                            gpu_types=types))
    return out


def _summary(nodes: list[NodeView], device: str) -> str:
    counts: dict[str, int] = {}
    for n in nodes:
        d = n.describe(device)
        counts[d] = counts.get(d, 0) + 1
    return ", ".join(f"{c} node(s) with {d}" for d, c in sorted(counts.items())) or "no nodes"


def _matching_accel(node: NodeView, wanted: GPUType) -> str | None:
    for t in node.gpu_types:
        if gpu_type_from_device_name(t) == wanted or t.lower() == wanted.value:
            return t
    return None


def plan(nodes: list[NodeView], *, gpus: int, gpu_type: GPUType | None,
         gpus_per_node: int | None, autoscaling: bool = False,
         force_cpu: bool | None = None) -> Layout:
    """The layout for ``gpus`` ranks, or a UserError saying what the cluster lacks."""
    if force_cpu is None:
        force_cpu = bool(os.environ.get("GPULAUNCH_FORCE_CPU"))
    has_gpu = any(n.gpus for n in nodes)
    device = "cuda" if has_gpu and not force_cpu else "cpu"
    if gpu_type is not None and device == "cpu":
        raise GPUTypeError(f"gpu_type={gpu_type.name} was requested, but the Ray cluster has "
                           f"no GPU: {_summary(nodes, 'cpu')}. Drop gpu_type, or add GPU nodes.")
    accel = None
    candidates = nodes
    if device == "cuda":
        candidates = [n for n in nodes if n.gpus]
        if gpu_type is not None:
            typed = [(n, _matching_accel(n, gpu_type)) for n in candidates]
            candidates = [n for n, t in typed if t]
            names = {t for _, t in typed if t}
            if not candidates and not autoscaling:
                raise GPUTypeError(
                    f"gpu_type={gpu_type.name} was requested, but no node of the Ray cluster "
                    f"has it: {_summary(nodes, 'cuda')}. Drop gpu_type or add such nodes.")
            accel = ACCEL_PREFIX + (sorted(names)[0] if names else gpu_type.name)
    slots = (lambda n: n.gpus) if device == "cuda" else (lambda n: n.cpus)
    unit = "GPU" if device == "cuda" else "CPU slot"
    largest = max((slots(n) for n in candidates), default=0)

    per_node = gpus_per_node
    if per_node is None:
        if largest == 0 and not autoscaling:
            raise GPUValidationError(f"gpus={gpus} was requested, but the Ray cluster has no "
                                     f"usable node: {_summary(nodes, device)}.")
        per_node = min(gpus, largest) if largest else gpus
    if gpus % per_node:
        raise GPUValidationError(
            f"gpus={gpus} does not divide into nodes of {per_node} {unit}s (the largest node of "
            f"the cluster has {largest}). Ask for a multiple of {per_node} (e.g. gpus="
            f"{(gpus // per_node + 1) * per_node}), or set RayCluster(gpus_per_node=...) to a "
            f"divisor of {gpus}.")
    nnodes = gpus // per_node
    fit = [n for n in candidates if slots(n) >= per_node]
    if len(fit) < nnodes and not autoscaling:
        what = (f"{nnodes} node(s) with {per_node} {unit}(s) each"
                + (f" of type {gpu_type.name}" if gpu_type else ""))
        raise GPUValidationError(
            f"gpus={gpus} cannot be placed on this Ray cluster: it needs {what} "
            f"(one node agent per node), and the cluster has {len(fit)} such node(s) "
            f"({_summary(nodes, device)}; {sum(slots(n) for n in fit)} {unit}s in total on "
            f"them). Missing: {nnodes - len(fit)} node(s) with {per_node} {unit}(s). Ask for "
            f"gpus<={len(fit) * per_node}, add nodes, or pass RayCluster(autoscaling=True) "
            "if the cluster grows on demand.")
    if device == "cuda":
        bundle = {"GPU": per_node}
        if accel:
            bundle[accel] = 0.001
    else:
        bundle = {"CPU": per_node}
    return Layout(device=device, nnodes=nnodes, nproc_per_node=per_node, bundle=bundle,
                  accel_resource=accel)


def reserve(ray, layout: Layout, *, timeout: float, name: str):
    """Create the placement group and wait (bounded) until every bundle is held."""
    from ray.util.placement_group import placement_group, remove_placement_group
    strategy = "STRICT_SPREAD" if layout.nnodes > 1 else "PACK"
    pg = placement_group([dict(layout.bundle) for _ in range(layout.nnodes)],
                         strategy=strategy, name=name)
    start = time.monotonic()
    try:
        ray.get(pg.ready(), timeout=timeout)
    except Exception as e:
        remove_placement_group(pg)
        if type(e).__name__ != "GetTimeoutError":
            raise
        free = [f"{k}={v:g}" for k, v in sorted(ray.available_resources().items())
                if k in ("CPU", "GPU") or k.startswith(ACCEL_PREFIX)]
        raise LaunchError(
            f"Could not reserve {layout.describe()} ({layout.nnodes} x {layout.bundle}, one per "
            f"node) within {timeout:g} s: the cluster has such nodes but they are busy with "
            f"other work. Free now: {', '.join(free) or 'nothing'}. Retry later, or raise "
            "RayCluster(placement_timeout=...).") from None
    return pg, time.monotonic() - start
