"""Read a Hugging Face config.json (file or directory) into a ModelShape, without transformers."""
from __future__ import annotations

import json
from pathlib import Path

from .shapes import ModelShape

# model_type values whose blocks follow the Llama layout (RMSNorm, SwiGLU, RoPE, GQA).
_DECODERS = {"llama", "mistral", "qwen2", "qwen3", "olmo", "olmo2", "olmo3", "gemma", "gemma2", "phi3",
             "granite", "smollm3", "gpt_oss", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3"}


def load(path: str | Path) -> ModelShape:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"no Hugging Face config at {p}: pass a config.json or the directory holding it")
    with p.open() as f:
        cfg = json.load(f)
    return from_dict(cfg, name=p.parent.name or p.stem)


def from_dict(cfg: dict, name: str = "hf-model") -> ModelShape:
    if "text_config" in cfg and "hidden_size" not in cfg:  # multimodal wrappers: plan the language model
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg.get("model_type"))}
    mt = cfg.get("model_type", "")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if k not in cfg]
    if missing:
        raise ValueError(f"config {name!r} (model_type={mt!r}) lacks {missing}; the planner understands "
                         f"decoder LMs like {sorted(_DECODERS)[:6]}...; pass a ModelShape for other models")
    heads = cfg["num_attention_heads"]
    h = cfg["hidden_size"]
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0
    inter = cfg.get("intermediate_size") or 4 * h
    if experts and cfg.get("moe_intermediate_size"):
        inter = cfg["moe_intermediate_size"]
    notes = ()
    if mt and mt not in _DECODERS:
        notes = (f"model_type {mt!r} treated as a Llama-style decoder",)
    return ModelShape(
        name=cfg.get("_name_or_path") or name,
        family="decoder",
        vocab_size=cfg["vocab_size"],
        hidden_size=h,
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or h // heads,
        intermediate_size=inter,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", mt == "gpt_oss")),
        qk_norm=mt in ("olmo2", "olmo3"),
        attention_sinks=mt == "gpt_oss",
        post_norms=mt in ("olmo2", "olmo3"),
        num_experts=int(experts),
        experts_per_token=int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 0),
        notes=notes,
    )
