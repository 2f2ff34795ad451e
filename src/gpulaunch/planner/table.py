"""The terminal table for a Plan."""
from __future__ import annotations

GiB = 1 << 30


def _g(n: int) -> str:
    return f"{n / GiB:7.2f}"


def render(p) -> str:
    s, m = p.setup, p.model
    lines = [
        f"model   {m.name}: {m.total_params / 1e9:.3f}B params"
        + (f" ({m.active_params / 1e9:.2f}B active)" if m.is_moe else "")
        + (f", LoRA r={s.lora_rank}" if s.lora else ""),
        f"setup   micro-batch {s.micro_batch_size} x seq {s.seq_len}, {s.precision}, {s.optimizer}"
        f", activation checkpointing {'on' if s.activation_checkpointing else 'off'}",
        f"machine {p.nodes} node(s) x {p.gpus_per_node} {p.gpu} ({p.gpu_memory_bytes / GiB:.1f} GiB each)",
    ]
    if p.mesh is not None:
        lines.append("mesh    " + ", ".join(f"{k} {v}" for k, v in p.mesh.items())
                     + (" (fsdp with replicate > 1 is HSDP)" if p.mesh["replicate"] > 1 else ""))
    lines += [
        "",
        f"{'technique':15s} {'params':>7s} {'grads':>7s} {'optim':>7s} {'activ':>7s} {'comm':>7s} {'other':>7s}"
        f" {'peak':>7s} {'on GPU':>7s}  {'fits':4s} {'rel.time':>8s}  peak during",
    ]
    for e in p.estimates:
        mark = "*" if (e.strategy == p.recommended and e.offload == p.recommended_offload) else " "
        lines.append(
            f"{mark}{e.key:14s} {_g(e.parameters)} {_g(e.gradients)} {_g(e.optimizer)} {_g(e.activations)}"
            f" {_g(e.communication)} {_g(e.overhead)} {_g(e.peak_allocated)} {_g(e.peak_device)}  "
            f"{'yes' if e.fits else 'NO':4s} {e.relative_step_time:8.2f}  {e.peak_phase}")
    lines += ["", "GiB per GPU. peak = largest moment of a step (not the column sum); on GPU adds CUDA context,",
              "NCCL and fragmentation.", f"recommended: {p.recommended + ('+offload' if p.recommended_offload else '') if p.recommended else 'none'} - {p.reason}"]
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)
