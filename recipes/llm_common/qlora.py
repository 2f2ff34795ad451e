"""QLoRA for the TRL LoRA recipe (``--load-in-4bit``): the base model's linear layers in 4 bits
through bitsandbytes, LoRA adapters on all of them, as a TRL user writes it::

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                               bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_use_double_quant=True)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, device_map=...)
    trainer = SFTTrainer(model=model, peft_config=LoraConfig(target_modules="all-linear", ...))

What the recipe does not do, and why:

- ``peft.prepare_model_for_kbit_training``: not called. TRL 1.16's ``SFTTrainer`` already does
  what QLoRA needs from it for a quantized model: ``get_peft_model`` freezes the base, TRL turns
  on input gradients when checkpointing, and it casts the trainable adapters to bf16 (the QLoRA
  paper's setting). The one other thing ``prepare_model_for_kbit_training`` does is upcast every
  weight that is not 4-bit (embeddings, LM head, norms: 0.8 B parameters for OLMo-3-7B) to fp32,
  which makes the residual stream fp32 and the LM head an fp32 matrix; Axolotl, which does call
  it, casts the norms and embeddings straight back to bf16 for LoRA/QLoRA
  (``ModelLoader._configure_embedding_dtypes``). Both end with bf16 non-quantized weights.
- Speed paths that do not fit a 4-bit base: see ``SPEED_WHY`` (``llm_common.speed`` applies it).

bitsandbytes 0.50.2 (the version the frameworks bundle carries to the GPU machine) quantizes
and runs ``Linear4bit`` forward and backward on CPU too (its ``libbitsandbytes_cpu.so`` and
torch ops), so the recipe trains QLoRA on CPU as on a GPU; on CPU the compute dtype is fp32
(the recipe's CPU precision).
"""

from __future__ import annotations

# Why each fast path of ``--speed auto`` is on or off over a 4-bit base. The Linear4bit
# modules peft wraps are ``peft.tuners.lora.bnb.Linear4bit``: their weight is packed nf4 bytes
# (a ``Params4bit``, uint8) with a ``QuantState`` beside it, and their forward dequantizes it
# and multiplies through bitsandbytes' own autograd function (``MatMul4Bit``).
SPEED_WHY = {
    # gpulaunch.hf.fuse_lora fuses peft's ``lora.Linear`` over a plain nn.Linear only (it needs
    # W in the activations' dtype to form W + sBA); peft's bnb wrapper is another class, which
    # fuse_lora would skip module by module anyway. Off, so the result does not claim it.
    "fuse_lora": "4-bit base: peft's bnb Linear4bit wrapper, whose packed nf4 weight the fused "
                 "forward cannot use (fuse_lora fuses lora.Linear over nn.Linear only)",
    # Compiling the decoder layers has run on a GPU only over bf16 weights. Over Linear4bit,
    # Dynamo has to trace bitsandbytes' Params4bit (a Parameter subclass carrying a Python
    # QuantState) and its MatMul4Bit autograd function in every projection. It does so here on
    # CPU in one graph, forward and backward (torch 2.14, bitsandbytes 0.50.2:
    # tests/recipes/test_qlora_settings.py), but whether inductor's code pays on a GPU (whose
    # image has torch 2.11) is unmeasured: eager layers, the safe choice, until
    # bench/llm_speed.py --group qlora measures -x compile=true beside it.
    "compile_layers": "4-bit base: compiling layers of bitsandbytes Linear4bit is not yet "
                      "measured on a GPU (Params4bit + MatMul4Bit in every projection); eager "
                      "until it is (-x compile=true forces it)",
    "torch_compile": "4-bit base: not compiling (compile_layers says why)",
    # Liger's RMSNorm/RoPE/SwiGLU kernels act on activations only, and its SwiGLU forward still
    # calls the module's own gate/up/down projections (here peft's bnb Linear4bit), so by the
    # code it applies over a 4-bit base. But Liger's patches over peft's bnb wrappers (and over
    # Olmo3, the bench's QLoRA model) have never run on a GPU here: off until measured, which
    # also keeps the TRL row comparable with Axolotl's (no Liger plugin in its config).
    "use_liger_kernel": "4-bit base: Liger over peft's bnb Linear4bit is not yet measured on a "
                        "GPU (by the code it applies: its kernels act on activations); off until "
                        "it is (-x liger=true forces it)",
}
# What still applies, unchanged: fused AdamW steps only the adapters. Attention (SDPA or
# FlashAttention) never touches the linear weights. The planner's gradient-checkpointing
# estimate counts the base at bf16: for a 4-bit base it may turn checkpointing on where 4 bits
# would fit (safe: slower, never out of memory).


def require_bitsandbytes() -> str:
    """bitsandbytes' version, or a SystemExit naming the fix (before anything starts)."""
    try:
        import bitsandbytes
    except ImportError:
        raise SystemExit(
            "--load-in-4bit needs bitsandbytes, which is not installed here: "
            "`pip install 'bitsandbytes>=0.50.2'` (it quantizes on CPU too). On the lent GPU, "
            "bench/llm_speed.sh puts the frameworks bundle's copy on the run's PYTHONPATH "
            "(carry .device-carry/llm-frameworks.tar.xz).") from None
    return bitsandbytes.__version__


def bnb_config(prec: str):
    """The BitsAndBytesConfig a TRL user passes: nf4 with double quantization, computing in the
    run's precision (bf16 on a GPU; fp32 on CPU, where the recipe trains in fp32)."""
    from transformers import BitsAndBytesConfig

    from .sft import torch_dtype
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_compute_dtype=torch_dtype(prec),
                              bnb_4bit_use_double_quant=True)


def refuse_prequantized(model_path: str | None) -> None:
    """A checkpoint that ships its own quantization (gpt-oss' MXFP4) cannot also be loaded in
    4 bits: transformers keeps one quantization_config per model."""
    import json
    from pathlib import Path
    if not model_path or not (Path(model_path) / "config.json").exists():
        return
    quant = json.loads((Path(model_path) / "config.json").read_text()).get("quantization_config")
    if quant:
        raise SystemExit(
            f"--load-in-4bit: {model_path} is already quantized "
            f"({quant.get('quant_method', quant)}); drop --load-in-4bit, or point --model at a "
            "bf16 checkpoint")


def quantize_random_base(model, quant, device):
    """A randomly initialised base, loaded again through ``from_pretrained`` with ``quant``:
    the same quantizer path as a checkpoint on disk (bitsandbytes Linear4bit in place of every
    nn.Linear but the LM head), from the weights in memory instead of files."""
    state = model.state_dict()
    cls, config, dtype = type(model), model.config, model.dtype
    del model
    # the model class itself: AutoModel's from_pretrained wants a path even with state_dict
    return cls.from_pretrained(
        None, config=config, state_dict=state, quantization_config=quant, dtype=dtype,
        device_map={"": device})


def unpacked_parameters(model) -> int:
    """Parameters as the model defines them: a 4-bit weight holds two values a byte (its
    ``numel`` is half the matrix); its QuantState keeps the real shape."""
    import math
    n = 0
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        n += math.prod(state.shape) if state is not None else p.numel()
    return n


def describe(model) -> dict:
    """What the result records: the 4-bit layers really there (counted, not configured)."""
    import bitsandbytes as bnb
    n = sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    q = getattr(getattr(model, "config", None), "quantization_config", None)
    q = q.to_dict() if hasattr(q, "to_dict") else (q or {})
    return {"linear4bit_modules": n, "bitsandbytes": bnb.__version__,
            "parameters": unpacked_parameters(model),
            "quant_type": q.get("bnb_4bit_quant_type"),
            "double_quant": q.get("bnb_4bit_use_double_quant"),
            "compute_dtype": str(q.get("bnb_4bit_compute_dtype"))}


def keep_trainable_in(model, prec: str) -> int:
    """Undo TRL's bf16 cast of the trainable parameters on an fp32 run (CPU). TRL's SFTTrainer
    casts every trainable parameter of a quantized model to bf16 (the QLoRA paper's adapters), on
    any device; in an fp32 run that leaves ``modules_to_save`` copies (the tiny preset's
    embeddings and LM head) in bf16 beside fp32 layers, and the next fp32 matmul fails ("mat1
    and mat2 must have the same dtype"). A bf16 run (GPU) keeps TRL's cast. Returns how many
    tensors were cast."""
    import torch
    if prec != "fp32":
        return 0
    n = 0
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
            n += 1
    return n
