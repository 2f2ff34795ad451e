"""Built-in architectures, written from their public Hugging Face config.json files.

Each entry's parameter count is derived by ModelShape from the dimensions; tests pin the totals
against the numbers the model cards publish (e.g. Llama-3.1-8B 8.03B, gpt-oss-120b 116.8B), so a
wrong dimension here fails a test rather than skewing every plan.
"""
from __future__ import annotations

from .shapes import ModelShape

_LLAMA3_VOCAB = 128256

CATALOG: dict[str, ModelShape] = {
    s.name: s
    for s in [
        ModelShape("llama-3.2-1b", vocab_size=_LLAMA3_VOCAB, hidden_size=2048, num_layers=16, num_heads=32,
                   num_kv_heads=8, head_dim=64, intermediate_size=8192, tie_embeddings=True),
        ModelShape("llama-3.2-3b", vocab_size=_LLAMA3_VOCAB, hidden_size=3072, num_layers=28, num_heads=24,
                   num_kv_heads=8, head_dim=128, intermediate_size=8192, tie_embeddings=True),
        ModelShape("llama-3.1-8b", vocab_size=_LLAMA3_VOCAB, hidden_size=4096, num_layers=32, num_heads=32,
                   num_kv_heads=8, head_dim=128, intermediate_size=14336),
        ModelShape("llama-3.1-70b", vocab_size=_LLAMA3_VOCAB, hidden_size=8192, num_layers=80, num_heads=64,
                   num_kv_heads=8, head_dim=128, intermediate_size=28672),
        # OLMo 3 7B: OLMo-2 layout (post-norms, full-width QK-norm, MHA) with a 100k vocabulary.
        ModelShape("olmo-3-7b", vocab_size=100278, hidden_size=4096, num_layers=32, num_heads=32,
                   num_kv_heads=32, head_dim=128, intermediate_size=11008, qk_norm=True, post_norms=True),
        # gpt-oss: MoE with biased attention, attention sinks, biased SwiGLU experts, a biased router.
        ModelShape("gpt-oss-20b", vocab_size=201088, hidden_size=2880, num_layers=24, num_heads=64,
                   num_kv_heads=8, head_dim=64, intermediate_size=2880, attention_bias=True, mlp_bias=True,
                   attention_sinks=True, num_experts=32, experts_per_token=4),
        ModelShape("gpt-oss-120b", vocab_size=201088, hidden_size=2880, num_layers=36, num_heads=64,
                   num_kv_heads=8, head_dim=64, intermediate_size=2880, attention_bias=True, mlp_bias=True,
                   attention_sinks=True, num_experts=128, experts_per_token=4),
        # A ~125M Llama-shaped model (GPT-2-small widths), used by the benchmarks as the small size.
        ModelShape("llama-125m", vocab_size=32000, hidden_size=768, num_layers=12, num_heads=12,
                   num_kv_heads=12, head_dim=64, intermediate_size=2048, tie_embeddings=False),
        # Recipes. The classifier's input vocabulary and positions are not fixed by its description
        # ("dim 512, 4 blocks, 8 heads, MLP ratio 4, ~12.9M params"); 512 tokens x 128 positions and
        # 2 classes reproduce the ~12.9M. Pass the nn.Module itself for exact counts.
        ModelShape("recipe-transformer-classifier", family="encoder", vocab_size=512, hidden_size=512,
                   num_layers=4, num_heads=8, intermediate_size=2048, mlp="gelu", norm="layernorm",
                   attention_bias=True, mlp_bias=True, max_position_embeddings=128, num_classes=2,
                   notes=("input vocabulary/positions assumed (512 x 128); pass the module for exact counts",)),
        ModelShape("recipe-mlp", family="generic", params_override=10 * 64 + 64 + 64 * 64 + 64 + 64 + 1,
                   notes=("10->64->64->1 MLP: activations are negligible and not modelled",)),
    ]
}

ALIASES = {
    "meta-llama/llama-3.2-1b": "llama-3.2-1b", "meta-llama/llama-3.2-3b": "llama-3.2-3b",
    "meta-llama/llama-3.1-8b": "llama-3.1-8b", "meta-llama/llama-3.1-70b": "llama-3.1-70b",
    "meta-llama/llama-3.2-1b-instruct": "llama-3.2-1b", "meta-llama/llama-3.2-3b-instruct": "llama-3.2-3b",
    "meta-llama/llama-3.1-8b-instruct": "llama-3.1-8b", "allenai/olmo-3-7b": "olmo-3-7b",
    "allenai/olmo-3-1025-7b": "olmo-3-7b",
    "openai/gpt-oss-20b": "gpt-oss-20b", "openai/gpt-oss-120b": "gpt-oss-120b",
}


def lookup(name: str) -> ModelShape | None:
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    return CATALOG.get(key)


def names() -> list[str]:
    return sorted(CATALOG)
