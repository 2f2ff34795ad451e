"""Estimated step time: compute at a realistic fraction of the GPU's bf16 peak, plus the part of the
communication that backward/forward compute cannot hide, plus host traffic for CPU offload.

Only the ratios between techniques are meant to be trusted (``relative_step_time``); the absolute
seconds assume MODEL_FLOPS_UTILIZATION, measured at ~0.39-0.46 for a 1B Llama on an H200 (FINDINGS.md).
"""
from __future__ import annotations

from ..hardware.catalog import GPUModel as GpuSpec
from .memory import Technique
from .shapes import ModelShape
from .training_setup import TrainingSetup

MODEL_FLOPS_UTILIZATION = 0.40
OVERLAP = 0.8                 # share of compute that can hide collectives (bucketed / prefetched)
CPU_ADAM_PARAMS_PER_S = 1e9   # DeepSpeed CPUAdam / torch CPU AdamW per GPU's share of host cores


def flops_per_step(shape: ModelShape, setup: TrainingSetup) -> float:
    T = setup.tokens
    n = shape.active_params
    # Forward 2N, backward 4N (input and weight gradients); frozen weights skip the weight gradient.
    dense = (4 * n + 6 * shape.lora_params(setup.lora_rank)) if setup.lora else 6 * n
    fwd = 2 * n
    attn = 0
    if shape.family != "generic":
        # Causal QK^T and AV: 2 * 2 * S * q per token forward, halved by the mask; x3 with backward.
        attn = 6 * shape.num_layers * setup.seq_len * shape.q_dim
    total = (dense + attn) * T
    if setup.activation_checkpointing:
        total += (fwd + attn / 3) * T
    return float(total)


def comm_bytes(shape: ModelShape, setup: TrainingSetup, tech: Technique, world: int) -> float:
    """Bytes each GPU sends per step (ring algorithms: (N-1)/N of the payload per pass)."""
    if world <= 1:
        return 0.0
    frac = (world - 1) / world
    c = setup.compute_bytes
    P = shape.total_params + (shape.lora_params(setup.lora_rank) if setup.lora else 0)
    Pt = shape.lora_params(setup.lora_rank) if setup.lora else P
    grad_b = 4 if (setup.precision in ("bf16", "fp16", "fp32") and tech.name in ("ddp", "fsdp")) else c
    if tech.name == "ddp":
        return 2 * frac * grad_b * Pt                        # all-reduce
    if tech.name in ("zero1", "zero2"):
        return frac * (c * Pt + c * P)                       # reduce-scatter grads + all-gather params
    return frac * (2 * c * P + grad_b * Pt)                  # gather fwd + bwd, reduce-scatter grads


def step_seconds(shape: ModelShape, setup: TrainingSetup, tech: Technique, world: int, nodes: int,
                 gpu: GpuSpec) -> float:
    compute = flops_per_step(shape, setup) / (gpu.bf16_tflops * 1e12 * MODEL_FLOPS_UTILIZATION)
    bw = (gpu.inter_node_gbps if nodes > 1 else gpu.intra_node_gbps) * 1e9
    comm = comm_bytes(shape, setup, tech, world) / bw
    exposed = max(0.0, comm - OVERLAP * compute)
    offload = 0.0
    if tech.offload:
        Pt = shape.lora_params(setup.lora_rank) if setup.lora else shape.total_params
        share = Pt / max(1, world)
        # Gradients down and updated parameters up over the host link, then the CPU optimizer step.
        offload = 2 * setup.compute_bytes * share / (gpu.host_link_gbps * 1e9) + share / CPU_ADAM_PARAMS_PER_S
        if tech.name in ("fsdp", "zero3"):  # parameters themselves stream from the host each pass
            offload += 2 * setup.compute_bytes * shape.total_params / max(1, world) / (gpu.host_link_gbps * 1e9)
    return compute + exposed + offload
