"""The seed notebooks' model architectures, as Hugging Face configs: real shape and tiny shape.

``--model PATH`` loads real weights from a local directory (the normal case on a GPU machine
that has them). Without it a recipe builds the same architecture with random weights: at the
real shape (``--full``, for throughput and memory runs) or at a tiny shape that trains in
seconds on a CPU (CI). The tiny shape keeps what matters to the parallel technique and to the
adapters: the same model class and module names (so FSDP wrap classes, LoRA ``all-linear`` and
the gpt-oss expert parameters are the same), grouped-query attention, tied or untied
embeddings; only widths, depths, expert counts and the vocabulary shrink.

Real shapes are those published in each model's ``config.json`` on the Hugging Face Hub.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
_GPT_OSS_ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                 "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}


@dataclass(frozen=True)
class Architecture:
    name: str                 # what --arch takes
    hub_id: str               # the checkpoint the seed notebook fine-tunes (for the docs/--model)
    model_type: str           # transformers' config model_type
    full: dict                # config kwargs of the real model
    tiny: dict                # overrides that make it CI-sized
    decoder_layer: str        # class FSDP wraps, one unit per layer
    notes: str = ""
    lora_expert_parameters: tuple[str, ...] = field(default=())  # MoE weights LoRA can adapt


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in [
    Architecture(
        "llama-3.2-1b", "meta-llama/Llama-3.2-1B-Instruct", "llama",
        dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, head_dim=64,
             max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
             rope_parameters=_LLAMA3_ROPE),
        dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=2048),
        "LlamaDecoderLayer", "TRL + DeepSpeed ZeRO-3 full fine-tune (seed notebook 6)"),
    Architecture(
        "llama-3.2-3b", "unsloth/Llama-3.2-3B-Instruct", "llama",
        dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
             num_attention_heads=24, num_key_value_heads=8, head_dim=128,
             max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
             rope_parameters=_LLAMA3_ROPE),
        dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=2048),
        "LlamaDecoderLayer", "Unsloth LoRA under DDP (seed notebook 7)"),
    Architecture(
        "llama-3.1-8b", "meta-llama/Llama-3.1-8B", "llama",
        dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=8, head_dim=128,
             max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
             rope_parameters=_LLAMA3_ROPE),
        dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=2048),
        "LlamaDecoderLayer", "LLM Foundry full fine-tune under FSDP (seed notebook 9)"),
    Architecture(
        "olmo-3-7b", "allenai/Olmo-3-7B-Instruct-SFT", "olmo3",
        dict(vocab_size=100278, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=65536,
             rms_norm_eps=1e-6, sliding_window=4096, tie_word_embeddings=False),
        dict(hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=2048, sliding_window=64),
        "Olmo3DecoderLayer", "Axolotl QLoRA under DDP (seed notebook 8)"),
    Architecture(
        "gpt-oss-20b", "openai/gpt-oss-20b", "gpt_oss",
        dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
             num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
             num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072,
             rms_norm_eps=1e-5, rope_parameters=_GPT_OSS_ROPE),
        dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
             sliding_window=32, max_position_embeddings=4096),
        "GptOssDecoderLayer", "TRL + LoRA under DDP (seed notebook 4)",
        ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")),
    Architecture(
        "gpt-oss-120b", "openai/gpt-oss-120b", "gpt_oss",
        dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
             num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=128,
             num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072,
             rms_norm_eps=1e-5, rope_parameters=_GPT_OSS_ROPE),
        dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
             sliding_window=32, max_position_embeddings=4096),
        "GptOssDecoderLayer", "TRL + LoRA (experts adapted too) under FSDP2 (seed notebook 5)",
        ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")),
]}


def get(name: str) -> Architecture:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ValueError(f"--arch {name!r} is not one of {sorted(ARCHITECTURES)}") from None


def config_kwargs(arch: Architecture, *, full: bool, tokenizer, layers: int | None = None) -> dict:
    """Config kwargs: the real shape, or the tiny one with the vocabulary cut to the tokenizer's
    (the real vocabulary is kept with ``full`` so parameter count and FLOPs are the real ones).
    ``layers``: fewer decoder layers at the same width (a real-width model that fits a GPU)."""
    kw = copy.deepcopy(arch.full)
    if not full:
        kw.update(copy.deepcopy(arch.tiny))
        kw.pop("rope_parameters", None)  # default rope at tiny length
        kw["vocab_size"] = len(tokenizer)
        if arch.model_type == "gpt_oss":
            kw["layer_types"] = ["sliding_attention", "full_attention"] * (kw["num_hidden_layers"] // 2)
        if arch.model_type == "olmo3":
            n = kw["num_hidden_layers"]
            kw["layer_types"] = ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n)]
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers {layers}: need at least 1 decoder layer")
        kw["num_hidden_layers"] = layers
        if "layer_types" in kw:
            kw["layer_types"] = (kw["layer_types"] * layers)[:layers]
    kw["vocab_size"] = max(kw["vocab_size"], len(tokenizer))
    kw.update(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
              eos_token_id=tokenizer.eos_token_id, use_cache=False)
    return kw


def build_config(arch_name: str, *, full: bool, tokenizer, layers: int | None = None):
    from transformers import AutoConfig
    arch = get(arch_name)
    kw = config_kwargs(arch, full=full, tokenizer=tokenizer, layers=layers)
    return AutoConfig.for_model(arch.model_type, **_for_installed_transformers(kw))


def _for_installed_transformers(kw: dict) -> dict:
    """transformers 4.x (LLM Foundry's environment pins <4.52) names RoPE settings
    ``rope_scaling`` + ``rope_theta``; 5.x takes them as one ``rope_parameters`` dict."""
    import transformers
    if int(transformers.__version__.split(".")[0]) >= 5 or "rope_parameters" not in kw:
        return kw
    kw = dict(kw)
    rope = dict(kw.pop("rope_parameters"))
    kw["rope_theta"] = rope.pop("rope_theta")
    kw["rope_scaling"] = rope
    return kw


def load_model(*, arch_name: str, model_path: str | None, full: bool, tokenizer, dtype,
               seed: int, attn_implementation: str | None = None, device_map=None,
               init_device=None, layers: int | None = None, quantization_config=None):
    """Real weights from ``model_path``, else the architecture randomly initialised from
    ``seed`` (identical on every rank, so DDP starts from one model even before its broadcast).
    ``init_device`` builds a random model directly there (a 20B model initialises in seconds on
    a GPU, in minutes on a CPU). ``quantization_config`` (QLoRA's BitsAndBytesConfig) applies to
    ``model_path`` only: a random base comes back unquantized, for the recipe to save as the
    adapter's base first (``llm_common.qlora.quantize_random_base`` then quantizes it)."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if model_path:
        if device_map is not None:
            kwargs["device_map"] = device_map
        quant = quantization_config or _mxfp4_dequantize_if_needed(model_path)
        if quant is not None:
            kwargs["quantization_config"] = quant
        model = AutoModelForCausalLM.from_pretrained(model_path, use_cache=False, **kwargs)
        if len(tokenizer) > model.get_input_embeddings().num_embeddings:
            model.resize_token_embeddings(len(tokenizer))
        return model
    config = build_config(arch_name, full=full, tokenizer=tokenizer, layers=layers)
    torch.manual_seed(seed)
    if init_device is not None and torch.device(init_device).type == "cuda":
        torch.cuda.manual_seed(seed)
        with torch.device(init_device):
            return AutoModelForCausalLM.from_config(config, **kwargs)
    return AutoModelForCausalLM.from_config(config, **kwargs)


def _mxfp4_dequantize_if_needed(model_path: str):
    """gpt-oss checkpoints ship MXFP4 experts; the seed notebooks load them dequantized to bf16
    (``Mxfp4Config(dequantize=True)``) so LoRA and FSDP see plain tensors."""
    import json
    from pathlib import Path
    cfg = Path(model_path) / "config.json"
    if not cfg.exists():
        return None
    quant = json.loads(cfg.read_text()).get("quantization_config") or {}
    if quant.get("quant_method") != "mxfp4":
        return None
    from transformers import Mxfp4Config
    return Mxfp4Config(dequantize=True)


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
