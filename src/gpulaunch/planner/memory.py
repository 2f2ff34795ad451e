"""Per-GPU bytes for each technique, phase by phase.

Peak memory is not the sum of parameters + gradients + optimizer + activations: gradients grow while
activations are freed during backward. So the peak is the largest of five moments of a steady-state
step (optimizer state already created, gradients set to None before forward):
  forward end     model states + kept activations + the loss computation
  backward start  model states + kept activations + the loss gradient (12 bytes per logit)
  backward layer  model states + kept activations + one block's backward (and its recompute)
  backward end    model states + all gradients (+ the last reduction's buffers)
  optimizer step  model states + gradients + optimizer temporaries
What each technique stores follows its PyTorch / DeepSpeed implementation with default settings;
the assumptions are the constants below, each named for what it models.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from . import activations as act
from .shapes import ModelShape
from .training_setup import OPTIMIZERS, TrainingSetup

MiB = 1 << 20
# cuBLAS/cuBLASLt workspaces come out of the caching allocator (so max_memory_allocated sees them).
ALLOC_WORKSPACE = 64 * MiB
# Not seen by max_memory_allocated but taking device memory: CUDA context + kernels (~0.5-0.8 GiB),
# NCCL communicators (~0.3-0.5 GiB), and allocator fragmentation (reserved - allocated, a few %).
CONTEXT_BYTES = 1024 * MiB
FRAGMENTATION = 0.05
# DeepSpeed defaults (deepspeed/runtime/zero/config.py): reduce_bucket_size and stage-3 prefetch.
DS_REDUCE_BUCKET = 500_000_000
DS_PREFETCH_BUCKET = 50_000_000

STRATEGIES = ("ddp", "fsdp", "zero1", "zero2", "zero3")
OFFLOADABLE = ("fsdp", "zero1", "zero2", "zero3")


@dataclass(frozen=True)
class Technique:
    name: str                 # one of STRATEGIES
    offload: bool = False     # optimizer state (and for fsdp/zero3 parameters) in CPU memory

    @property
    def key(self) -> str:
        return self.name + ("+offload" if self.offload else "")


@dataclass(frozen=True)
class MemoryBreakdown:
    parameters: int
    gradients: int
    optimizer: int            # optimizer state plus fp32 master weights where kept separately
    activations: int          # at the peak moment (kept + transient), incl. the loss
    communication: int        # DDP buckets, gathered FSDP/ZeRO-3 layers, ZeRO reduce buckets
    overhead: int             # allocator-visible workspaces
    peak_allocated: int       # what torch.cuda.max_memory_allocated should report
    peak_phase: str
    phases: dict = field(default_factory=dict)
    cpu_bytes: int = 0        # host memory for offloaded state (per GPU)

    @property
    def peak_device(self) -> int:
        """What the GPU must hold: allocated peak + fragmentation + CUDA context/NCCL."""
        return int(self.peak_allocated * (1 + FRAGMENTATION)) + CONTEXT_BYTES


def _counts(shape: ModelShape, setup: TrainingSetup) -> tuple[int, int]:
    total = shape.total_params
    if setup.lora:
        if shape.family == "generic":
            raise ValueError(f"lora_rank needs a transformer shape; {shape.name!r} only has a parameter count")
        return total + shape.lora_params(setup.lora_rank), shape.lora_params(setup.lora_rank)
    trainable = shape.trainable_override if shape.trainable_override is not None else total
    return total, trainable


def estimate(shape: ModelShape, setup: TrainingSetup, tech: Technique, world: int,
             tensor: int = 1) -> MemoryBreakdown:
    """``world``: the ranks the states are divided over; ``tensor`` > 1 (FSDP2 x tensor parallel,
    with ``world`` = shard x context x tensor): each rank gathers 1/tensor of a block, and sequence
    parallelism keeps 1/tensor of each block's activations (planner/mesh.py)."""
    P, Pt = _counts(shape, setup)
    Pf = P - Pt
    N = max(1, world)
    c = setup.compute_bytes
    n_states = OPTIMIZERS[setup.optimizer]
    mixed = setup.precision in ("bf16", "fp16")
    name, off = tech.name, tech.offload
    layer = shape.largest_layer_params if shape.family == "generic" else shape.layer_params()
    root = 0 if shape.family == "generic" else shape.embedding_params() + shape.head_params()
    layer, root = layer // tensor, root // tensor   # what one tensor-parallel rank gathers
    linear_params = max(0, P - root) if shape.family != "generic" else P
    if not shape.head_params() and shape.family == "decoder":
        linear_params += shape.vocab_size * shape.hidden_size  # tied head is still a matmul

    # --- what each technique stores, in bytes -------------------------------------------------
    cache = 0         # autocast's bf16 weight copies, alive from forward to their block's backward
    gathered_idle = 0  # unsharded parameters kept between forward and backward (FSDP root)
    gathered = 0      # unsharded parameters alive while a block runs (FSDP, ZeRO-3): idle + blocks
    grad_transient = 0
    buckets = 0
    step_tmp = 0
    cpu = 0
    mode = act.PURE
    adapter_bytes = c
    if name == "ddp":
        if setup.lora:
            # Base in the compute dtype, fp32 adapters (peft default); optimizer follows the adapters.
            pb, sb, gb = (2 if mixed else 4), 4, 4
            adapter_bytes = 4
            params = pb * Pf + 4 * Pt
        else:
            pb = 4 if setup.precision != "bf16-pure" else 2
            sb = gb = pb
            params = pb * P
            if mixed:
                mode = act.AUTOCAST
                cache = 2 * linear_params
        opt = n_states * sb * Pt
        grads = gb * Pt
        buckets = gb * Pt          # DDP's reducer keeps flat buckets beside .grad (gradient_as_bucket_view=False)
        step_tmp = sb * Pt if setup.optimizer_impl == "foreach" and n_states else 0
    elif name == "fsdp":
        # FSDP2 fully_shard per block + root, MixedPrecisionPolicy(bf16, reduce fp32) for "bf16".
        # With LoRA the whole model is bf16 (FSDP2 wants one dtype per group), so is the optimizer.
        pure_dtype = setup.lora or setup.precision == "bf16-pure"
        sb = c if pure_dtype else 4
        params = sb * P // N
        opt = n_states * sb * Pt // N
        grads = sb * Pt // N
        # The root group (embedding, head, final norm) is not resharded after forward; each block is
        # all-gathered in the compute dtype, with the next one prefetched, and resharded after use
        # (checked on CPU with bench/planner_livebytes.py: after forward only the root stays gathered).
        gathered_idle = c * root
        gathered = gathered_idle + 2 * c * layer
        # Backward: a block's unsharded gradient (compute dtype) and its fp32 copy for reduce-scatter.
        grad_transient = (c + (4 if not pure_dtype else 0)) * (layer if not setup.lora else 0)
        step_tmp = sb * Pt // N if setup.optimizer_impl == "foreach" and n_states else 0
        if off:  # CPUOffloadPolicy: sharded params, grads and optimizer live on the host
            cpu = params + opt + grads
            params = opt = grads = step_tmp = 0
    else:
        stage = int(name[-1])
        # DeepSpeed bf16: parameters bf16, fp32 master + optimizer state partitioned over N.
        params = c * (P // N if stage == 3 else P)
        master = 4 * Pt // N if mixed or c == 2 else 0
        opt = master + n_states * 4 * Pt // N
        grads = c * (Pt if stage == 1 else Pt // N)
        # Stage 3 allocates its reduce bucket at full reduce_bucket_size whatever the model size
        # (measured on CPU: +954 MiB for a 2M-parameter model); stage 2 flattens up to one bucket.
        buckets = c * (DS_REDUCE_BUCKET if stage == 3 else min(DS_REDUCE_BUCKET, Pt)) if stage >= 2 else 0
        # At step DeepSpeed flattens its gradient partition (a copy in the compute dtype) and converts
        # that to fp32 for the optimizer, while the gradients themselves are still held: traced on an
        # H200 with `bench/planner_measure.py --trace` (1B ZeRO-1, bf16: +2P flat, +4P fp32 at the peak).
        step_tmp = 4 * Pt // N + (c * Pt // N if c < 4 else 0)
        if stage == 3:
            gathered = c * (2 * layer + min(DS_PREFETCH_BUCKET, layer))
            gathered_idle = 0
        if off:
            cpu = opt + step_tmp + (4 * Pt // N)
            opt = step_tmp = 0
            grads = 0 if stage >= 2 else grads
            if stage == 3:
                cpu += params
                params = 0

    prof = act.profile(shape, setup, mode, adapter_bytes)
    if tensor > 1:   # sequence parallel: blocks' activations and their inputs split over the tensor ranks
        prof = replace(prof, per_layer=prof.per_layer // tensor, checkpoint=prof.checkpoint // tensor,
                       layer_backward_transient=prof.layer_backward_transient // tensor)
    static = params + opt + buckets + ALLOC_WORKSPACE
    head_grad = (4 if name == "ddp" and not setup.lora else c) * (shape.vocab_size * shape.hidden_size
                                                                 if not setup.lora and shape.family == "decoder" else 0) // (N if name in ("fsdp", "zero2", "zero3") else 1)
    in_flight = static + gathered_idle + cache + prof.saved
    phases = {
        "forward end": in_flight + prof.loss_forward,
        "backward start": in_flight + prof.loss_backward,
        "backward layer": in_flight + (gathered - gathered_idle) + prof.recompute + prof.layer_backward_transient
        + head_grad + grad_transient,
        "backward end": static + grads + grad_transient + (c * root if name == "fsdp" else 0),
        "optimizer step": static + grads + step_tmp,
    }
    phase = max(phases, key=phases.get)
    peak = phases[phase]
    # The activation column shows the activations' own largest moment; peak_phase says which moment
    # of the step is the overall peak (for a big model with a small batch it is the optimizer step).
    activ = max(prof.saved + prof.loss_forward, prof.saved + prof.loss_backward,
                prof.saved + prof.recompute + prof.layer_backward_transient)
    return MemoryBreakdown(parameters=params, gradients=grads, optimizer=opt, activations=activ,
                           communication=buckets + gathered + grad_transient, overhead=ALLOC_WORKSPACE + cache,
                           peak_allocated=peak, peak_phase=phase, phases=phases, cpu_bytes=cpu)
