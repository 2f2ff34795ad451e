"""Model shapes, token batches, FLOP counts and the optimizer shared by the throughput benches
(``gpu_throughput.py``, ``gpu_profile.py``, ``scaling_gpu.py``, ``parallel_gpu.py``).

* ``recipe``: the FSDP2 transformer recipe's shape: dim 512, 4 blocks, 8 heads, MLP 4 x dim
  (SwiGLU ffn 2048), vocab 32000; micro-batch 16 x seq 1024;
* ``1b``: Llama-3.2-1B's shape (1.24 B parameters, tied embeddings); micro-batch 4 x seq 2048
  (the shape of the by-hand anchor, ``../shared/anchors/hf_llama_loop.py``).

MFU = tokens/s x FLOPs per token / peak. FLOPs per token = 6 N + 12 L d T (N: parameters in
matmuls, i.e. all but the input embedding unless it is tied to the output head; L layers,
d model width, T sequence length; the attention term counts the full T x T product, the PaLM
convention). Peak: dense bf16 of the GPU (H100/H200 989 TFLOP/s; ``--peak-tflops`` overrides).
"""

from __future__ import annotations

import dataclasses

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0,
                    "L4": 121.0}
CHUNKED_LOSS_TOKENS = 1024


def model_config(name: str, smoke: bool, chunked_loss: int = 0):
    from gpulaunch.parallel.reference_model import LLAMA_1B, LlamaConfig
    if smoke:  # same code paths, sized for a 2-core CPU
        cfg = LlamaConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4,
                          n_kv_heads=4 if name == "recipe" else 2, ffn_dim=256, max_seq_len=64)
    elif name == "1b":
        cfg = LLAMA_1B
    else:
        cfg = LlamaConfig(vocab_size=32000, dim=512, n_layers=4, n_heads=8, n_kv_heads=8, ffn_dim=2048,
                          max_seq_len=1024)
    return dataclasses.replace(cfg, chunked_loss=chunked_loss) if chunked_loss else cfg


def shape_defaults(name: str, smoke: bool) -> tuple[int, int]:
    if smoke:
        return 2, 64
    return (4, 2048) if name == "1b" else (16, 1024)


def flops_per_token(cfg, seq: int) -> float:
    n = cfg.num_params()
    if not cfg.tie_embeddings:
        n -= cfg.vocab_size * cfg.dim          # the input embedding is a lookup, not a matmul
    n -= cfg.n_layers * 2 * cfg.dim + cfg.dim  # norm weights
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.dim * seq


def peak_flops(device_name: str | None, override: float | None) -> float | None:
    if override:
        return override * 1e12
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if device_name and key in device_name:
            return tflops * 1e12
    return None


def batches(cfg, steps: int, batch: int, seq: int, device):
    """Deterministic token batches (an arithmetic progression per row: learnable, no dataset)."""
    import torch
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(10_000 + step)
        start = torch.randint(0, cfg.vocab_size, (batch, 1), generator=g)
        stride = torch.randint(1, 8, (batch, 1), generator=g)
        s = (start + stride * torch.arange(seq + 1)) % cfg.vocab_size
        out.append((s[:, :-1].contiguous().to(device), s[:, 1:].contiguous().to(device)))
    return out


def _adamw(params, device, lr):
    import torch
    fused = device.type == "cuda"
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=fused, foreach=not fused)
