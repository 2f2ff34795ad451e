"""What a training run did with its time: steady-state tokens/s, MFU, and the seconds spent
outside optimizer steps (start-up, evaluation, saving).

FLOP convention: the one ``bench/gpu_throughput.py`` uses, so the numbers compare with its
plain-PyTorch bar. Model FLOPs per token = 6 N + 12 L d T, where N counts parameters in matmuls
(all but the input embedding unless it is tied to the head; norms and biases left out; an MoE
expert counted with weight top_k / experts, since a token only visits top_k of them), L layers,
d the attention width (heads x head_dim), T the sequence length (the window, for a
sliding-window layer). It is the *model* FLOPs of a full fine-tune; a LoRA run does fewer
(frozen weights get no weight gradient) and gradient checkpointing does more (recompute), and
neither changes the convention: MFU says how fast the model trains, not how busy the GPU is.
Peak: the GPU's dense bf16 datasheet number (H100/H200 989 TFLOP/s); ``-x peak_tflops=X``
overrides (it is how the CPU tests check the arithmetic).
"""

from __future__ import annotations

import time

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0,
                    "L4": 121.0}


def matmul_parameters(config) -> float:
    """N of the convention, from the model's config (built on the meta device: no memory).
    The class is called directly, not through ``from_config``, which under an active ZeRO-3
    config would partition the meta model with ``deepspeed.zero.Init``."""
    import torch
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    with torch.device("meta"):
        model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    n = 0.0
    for name, p in model.named_parameters():   # tied weights appear once
        if p.dim() < 2 or name.endswith("bias"):
            continue
        if "embed_tokens" in name and not tied:
            continue                           # a lookup; the separate head is the matmul
        share = top_k / experts if experts and top_k and ".experts." in name else 1.0
        n += p.numel() * share
    return n


def attention_flops_per_token(config, seq_len: int) -> float:
    layers = config.num_hidden_layers
    width = config.num_attention_heads * (getattr(config, "head_dim", None)
                                          or config.hidden_size // config.num_attention_heads)
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * layers
    window = getattr(config, "sliding_window", None) or seq_len
    spans = [min(seq_len, window) if k == "sliding_attention" else seq_len for k in kinds[:layers]]
    return 12.0 * width * sum(spans)


def flops_per_token(config, seq_len: int) -> float:
    return 6.0 * matmul_parameters(config) + attention_flops_per_token(config, seq_len)


def peak_flops(device, override_tflops=None) -> float | None:
    """Dense bf16 peak of one device, or None (unknown GPU, or a CPU) unless overridden."""
    if override_tflops:
        return float(override_tflops) * 1e12
    if getattr(device, "type", str(device)) != "cuda":
        return None
    import torch
    name = torch.cuda.get_device_name(device)
    return next((t * 1e12 for k, t in PEAK_BF16_TFLOPS.items() if k in name), None)


def throughput(config, *, seq_len: int, tokens_per_second: float | None, world_size: int,
               device, override_tflops=None) -> dict:
    """flops_per_token, peak and MFU for a measured rate (tokens/s of all ranks together)."""
    fpt = flops_per_token(config, seq_len)
    peak = peak_flops(device, override_tflops)
    mfu = (tokens_per_second * fpt / (peak * world_size)
           if peak and tokens_per_second else None)
    return {"flops_per_token": fpt, "peak_flops_per_device": peak, "mfu": mfu,
            "mfu_convention": "6N(active, matmul) + 12*L*d_attn*T per token, / dense bf16 peak"}


def steady_state(step_seconds: list[float], step_tokens: list[int], skip: int) -> dict:
    """Tokens/s over the steps after the first ``skip`` (kernel selection, allocator growth and
    the first collectives happen there); all steps when the run is too short to skip any."""
    skip = skip if len(step_seconds) > skip else 0
    secs, toks = sum(step_seconds[skip:]), sum(step_tokens[skip:])
    return {"steady_tokens_per_second": toks / secs if secs else None,
            "steady_steps": len(step_seconds) - skip, "warmup_steps_skipped": skip,
            "median_step_seconds": sorted(step_seconds[skip:])[len(step_seconds[skip:]) // 2]
            if step_seconds[skip:] else None}


def time_split(started_at: float, timeline: dict, *, step_seconds: float, eval_seconds: float,
               finished_at: float | None = None) -> dict:
    """Where a run's wall time went, from the rank's timestamps (epoch seconds, one machine's
    clock) and the caller's: start-up (process start to the first training step's loop, i.e.
    launch, imports, model, data, trainer), steps, evaluation, the rest of ``train()``
    (logging, data loading), saving and checks after training, and what the caller did after
    (reload, generation)."""
    finished_at = finished_at or time.time()
    train_s = timeline["train_end"] - timeline["train_start"]
    out = {
        "startup_s": timeline["train_start"] - started_at,
        "launch_s": timeline["entry"] - started_at,        # part of startup: until train() runs
        "steps_s": step_seconds,
        "eval_s": eval_seconds,
        "train_other_s": max(0.0, train_s - step_seconds - timeline.get("eval_in_train_s", 0.0)),
        "save_s": max(0.0, timeline["exit"] - timeline["train_end"]
                      - timeline.get("eval_after_s", 0.0)),
        "after_s": finished_at - timeline["exit"],
        "total_s": finished_at - started_at,
    }
    out["outside_steps_s"] = out["total_s"] - step_seconds
    return out
