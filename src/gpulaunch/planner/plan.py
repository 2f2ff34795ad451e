"""plan(): every technique's memory and time for one model, setup and machine, and a choice."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from . import memory, timing
from . import mesh as mesh_plan
from .inputs import resolve_model
from .memory import OFFLOADABLE, STRATEGIES, Technique
from .shapes import ModelShape
from .training_setup import TrainingSetup

GiB = 1 << 30
# Prefer the simpler technique when step times are this close: fewer moving parts, fewer deps.
_TIE = 0.03
_SIMPLICITY = ["ddp", "fsdp", "zero1", "zero2", "zero3"]


class NothingFitsError(ValueError):
    """No technique fits the GPUs with this setup. The message names the smallest and what to change."""


@dataclass(frozen=True)
class Estimate:
    strategy: str             # ddp | fsdp | zero1 | zero2 | zero3
    offload: bool
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    communication: int
    overhead: int
    peak_allocated: int       # compare with torch.cuda.max_memory_allocated
    peak_device: int          # + CUDA context, NCCL, fragmentation: compare with the GPU's memory
    peak_phase: str
    fits: bool
    headroom: int             # gpu memory - peak_device (negative when it does not fit)
    step_seconds: float
    relative_step_time: float  # 1.0 = fastest technique that fits (or fastest overall if none fits)
    cpu_bytes: int = 0
    phases: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.strategy + ("+offload" if self.offload else "")


@dataclass(frozen=True)
class Plan:
    model: ModelShape
    setup: TrainingSetup
    gpu: str
    gpu_memory_bytes: int
    gpus_per_node: int
    nodes: int
    estimates: tuple[Estimate, ...]
    recommended: str | None       # strategy name, None when nothing fits
    recommended_offload: bool
    reason: str
    notes: tuple[str, ...] = ()
    mesh: dict | None = None      # replicate/shard/context/tensor sizes, when planned for a mesh

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def fits(self) -> bool:
        return self.recommended is not None

    def estimate(self, strategy: str, offload: bool = False) -> Estimate:
        for e in self.estimates:
            if e.strategy == strategy and e.offload == offload:
                return e
        raise KeyError(f"no estimate for {strategy}{'+offload' if offload else ''}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["model"] = {**asdict(self.model), "total_params": self.model.total_params,
                      "active_params": self.model.active_params}
        d["world_size"] = self.world_size
        return d

    def __str__(self) -> str:
        from .table import render
        return render(self)


def _gib(n: int) -> str:
    return f"{n / GiB:.1f}"


def plan(model, *, micro_batch_size: int = 1, seq_len: int = 2048, precision: str = "bf16",
         optimizer: str = "adamw", optimizer_impl: str = "foreach", lora_rank: int | None = None,
         activation_checkpointing: bool = False, gpus_per_node: int | None = None, nodes: int = 1,
         gpu: str | None = None, gpu_memory_bytes: int | None = None,
         strategies=None, offload: bool = True, mesh=None) -> Plan:
    """Estimate every technique (``strategies`` restricts them; ``offload=False`` drops CPU-offload
    variants) and recommend the fastest that fits. Raises ValueError on bad input, naming the fix.

    ``mesh``: replicate x shard x context x tensor sizes (a dict, ``"replicate=2,shard=4"`` or a
    ``gpulaunch.parallel.Mesh``) over the ``gpus_per_node * nodes`` GPUs: the techniques that can
    run that layout, estimated for it (:mod:`gpulaunch.planner.mesh`)."""
    shape = resolve_model(model)
    setup = TrainingSetup(micro_batch_size=micro_batch_size, seq_len=seq_len, precision=precision,
                          optimizer=optimizer, optimizer_impl=optimizer_impl, lora_rank=lora_rank,
                          activation_checkpointing=activation_checkpointing)
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    spec, detected = _machine(gpu, gpu_memory_bytes)
    if gpus_per_node is None:
        gpus_per_node = len(detected.gpus) if detected else 1
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    mem = gpu_memory_bytes or spec.memory_bytes
    world = gpus_per_node * nodes
    sizes = mesh_plan.resolve_mesh(mesh, world) if mesh is not None else None
    if sizes is not None:
        allowed = mesh_plan.techniques(sizes)
        if strategies is None:
            strategies = allowed + [f"{n}+offload" for n in allowed if n in OFFLOADABLE and offload]
        bad = [n for n in strategies if n.lower().partition("+")[0] not in allowed]
        if bad:
            raise ValueError(f"{', '.join(bad)} cannot run the mesh {mesh_plan.label(sizes)}: it takes "
                             f"{', '.join(allowed)}")
    wanted = _techniques(strategies, offload)

    raw = []
    for tech in wanted:
        if sizes is not None:
            m = mesh_plan.estimate(shape, setup, tech, sizes)
            t = mesh_plan.step_seconds(shape, setup, tech, sizes, gpus_per_node, nodes, spec)
        else:
            m = memory.estimate(shape, setup, tech, world)
            t = timing.step_seconds(shape, setup, tech, world, nodes, spec)
        raw.append((tech, m, t))
    fitting = [t for tech, m, t in raw if m.peak_device <= mem]
    best_t = min(fitting) if fitting else min(t for _, _, t in raw)
    estimates = tuple(
        Estimate(strategy=tech.name, offload=tech.offload, parameters=m.parameters, gradients=m.gradients,
                 optimizer=m.optimizer, activations=m.activations, communication=m.communication,
                 overhead=m.overhead, peak_allocated=m.peak_allocated, peak_device=m.peak_device,
                 peak_phase=m.peak_phase, fits=m.peak_device <= mem, headroom=mem - m.peak_device,
                 step_seconds=t, relative_step_time=t / best_t, cpu_bytes=m.cpu_bytes, phases=dict(m.phases))
        for tech, m, t in raw)
    rec, reason = _recommend(estimates, mem, world)
    notes = tuple(shape.notes)
    if shape.is_moe:
        notes += ("MoE activation model is approximate (not yet measured)",)
    return Plan(model=shape, setup=setup, gpu=spec.name if not gpu_memory_bytes or gpu else "custom",
                gpu_memory_bytes=mem, gpus_per_node=gpus_per_node, nodes=nodes, estimates=estimates,
                recommended=rec.strategy if rec else None, recommended_offload=bool(rec and rec.offload),
                reason=reason, notes=notes, mesh=sizes)


def choose_strategy(model, **kwargs) -> tuple[str, str]:
    """(strategy, reason) for prepare(strategy="auto"): the fastest technique that fits, without CPU
    offload unless nothing else fits. Raises NothingFitsError when nothing fits at all."""
    p = plan(model, **kwargs)
    if p.recommended is None:
        raise NothingFitsError(p.reason)
    return p.recommended + ("+offload" if p.recommended_offload else ""), p.reason


def _machine(gpu, gpu_memory_bytes):
    """The GPU model to plan for (and the GPUs found here, when none was named)."""
    from ..hardware import catalog, host
    detected = None
    if gpu is not None:
        spec = catalog.model_for(gpu)
    else:
        found = host.detect()
        if found.has_gpu:
            detected = found
            g = found.gpus[0]
            # an unknown model: its memory, H100-like speed for relative times
            spec = (g.model or catalog.MODELS["H100"]).with_memory(g.memory_bytes)
        elif gpu_memory_bytes:
            spec = catalog.MODELS["H100"]
        else:
            raise ValueError("no GPU detected here: pass gpu= (e.g. 'H100', 'A10'; one of "
                             f"{', '.join(catalog.MODELS)}) or gpu_memory_bytes=")
    return spec, detected


def _techniques(strategies, offload: bool) -> list[Technique]:
    names = list(STRATEGIES) if strategies is None else [s.lower() for s in strategies]
    out = []
    for n in names:
        base, _, off = n.partition("+")
        if base not in STRATEGIES or off not in ("", "offload"):
            raise ValueError(f"unknown strategy {n!r}: use {', '.join(STRATEGIES)} (optionally +offload)")
        if off:
            out.append(Technique(base, True))
            continue
        out.append(Technique(base))
        if offload and base in OFFLOADABLE and strategies is None:
            out.append(Technique(base, True))
    return out


def _recommend(estimates, mem: int, world: int):
    fitting = [e for e in estimates if e.fits]
    if not fitting:
        best = min(estimates, key=lambda e: e.peak_device)
        return None, (f"nothing fits: the smallest, {best.key}, needs {_gib(best.peak_device)} GiB per GPU of "
                      f"{_gib(mem)} GiB; lower micro_batch_size, enable activation_checkpointing, use LoRA, "
                      f"or add GPUs")
    # Offload only when nothing on-GPU fits: its step time depends on host cores we cannot see.
    pool = [e for e in fitting if not e.offload] or fitting
    fastest = min(e.step_seconds for e in pool)
    near = [e for e in pool if e.step_seconds <= fastest * (1 + _TIE)]
    pick = min(near, key=lambda e: _SIMPLICITY.index(e.strategy))
    used = f"{_gib(pick.peak_device)} of {_gib(mem)} GiB"
    ddp = next((e for e in estimates if e.strategy == "ddp"), None)
    if pick.strategy == "ddp":
        why = f"ddp fits ({used}) and needs no sharding" + (": fastest" if world > 1 else "")
    elif ddp is not None and not ddp.fits:
        why = (f"ddp needs {_gib(ddp.peak_device)} GiB > {_gib(mem)} GiB; {pick.key} fits ({used})"
               + (" and is the fastest that does" if len(pool) > 1 else ""))
    else:
        why = f"{pick.key} fits ({used}) and has the lowest estimated step time"
    if pick.offload:
        why += "; only with CPU offload (slower, needs host memory)"
    return pick, why
