"""The HF Trainer / TRL ``SFTConfig`` fields that make a fine-tune fast on this host, each with
the reason it is (or is not) set.

    from gpulaunch.hf import speed_settings
    s = speed_settings(model.config, technique="ddp", seq_len=2048, micro_batch_size=4,
                       lora_rank=8)
    print(s)                                    # every choice and why
    config = SFTConfig(output_dir="out", **s.trainer_args)
    model = AutoModelForCausalLM.from_pretrained(path, **s.model_kwargs)
    trainer = SFTTrainer(model=model, args=config, ...)
    if s.fuse_lora:
        fuse_lora(trainer.model)                # gpulaunch.hf.fuse_lora
    if s.compile_layers:
        compile_layers(trainer.model)           # gpulaunch.hf.compile_layers

What it decides (GPU / CPU):

- ``bf16`` and ``tf32``: bf16 weights and activations where the GPU has bf16; fp32 on CPU.
- ``optim="adamw_torch_fused"``: one kernel for the whole AdamW step on a GPU.
- ``compile_layers`` (not a trainer field; ``gpulaunch.hf.compile_layers(trainer.model)`` after
  the trainer is built): ``torch.compile`` of each decoder layer's forward, one graph for all of
  them, on a GPU; under ZeRO-3 with each layer one ZeRO-3 unit (``zero3_layers``:
  ``gpulaunch.hf.zero3_layer_units(trainer.model)`` first, so DeepSpeed's hooks sit around the
  layer, not inside it); except for MoE models whose experts transformers runs as a Python
  loop over the routed experts (``nonzero``: a graph break and a graph per routing); MoE experts run as grouped GEMMs
  (``experts_implementation="grouped_mm"``) trace into one graph; FSDP2's and DDP's hooks sit around the
  layer and stay eager. ``trainer_args["torch_compile"]`` stays False: compiling the whole
  model also traces TRL's chunked LM head, whose scored-position count changes every batch on
  a GPU (``gpulaunch.hf.regional_compile`` says what that cost). ``compile=True`` forces the
  layers compiled, ``compile="model"`` the trainer's whole-model compile. Off on CPU (compile
  time, little gain).
- ``pad_to_multiple_of``: 64 when compiling rows that are padded (not padding-free): rows of
  2040-2048 tokens then make one shape, not one compiled graph for fixed and one for dynamic
  lengths.
- ``use_liger_kernel``: Liger's fused RMSNorm/RoPE/SwiGLU, on a GPU when ``liger-kernel`` is
  installed and supports the model type, and only when not compiling. Triton kernels: never on
  CPU. TRL's ``SFTTrainer`` applies only these layer kernels (its own chunked LM head replaces
  Liger's fused linear cross-entropy, so the logits never fill memory either way). Under
  ``torch.compile`` they bring nothing inductor does not fuse by itself, and each Triton call
  breaks the graph inside every decoder layer; with the whole model compiled, the layers'
  forwards then ran as frames of their own, and transformers' ``deprecate_kwarg`` wrapper (one
  code object shared by the causal LM, the base model, every decoder layer and attention)
  filled Dynamo's cache for that code object (``recompile_limit``, 8) within a few steps.
- ``attn_implementation`` (``model_kwargs``): FlashAttention-2 when ``flash_attn`` is installed;
  else left to transformers, whose default is PyTorch SDPA where the model has it. Models with
  attention sinks (gpt-oss), which transformers runs eagerly (no SDPA path; FlashAttention-2 has
  no sinks): ``gpulaunch.hf.sink_attention`` (SDPA with the sink as one more key, exact),
  registered with transformers by this call, on CPU too.
- ``experts_implementation`` (``model_kwargs``, MoE): ``"grouped_mm"``, one grouped GEMM per
  projection for all experts (transformers' own default for the MoE classes that support it;
  named so that it holds), where the model class supports it.
- ``padding_free``: only with FlashAttention (variable-length rows in one flattened batch); with
  SDPA a padding-free batch needs a block-diagonal mask, which leaves SDPA's flash kernel.
  Packing (``packed=True``) is TRL's best-fit-decreasing packing, padding-free by itself.
- ``gradient_checkpointing``: only when gpulaunch's planner says the step does not fit without
  it on this GPU (it recomputes the forward: ~1/3 more arithmetic).
- ``fuse_lora``: for LoRA (``lora_rank`` given), peft's adapters computed with the base matmul
  (``gpulaunch.hf.fuse_lora``); exact, so on CPU too.
- ``fsdp_config`` (FSDP2 only; merge into the trainer's ``fsdp_config``):
  ``reshard_after_forward=False`` with one process on a GPU where the planner leaves room for a
  second copy of the weights (one rank's shard is the whole weight, so resharding frees only the
  gathered copy and gathers each layer again in backward; ``prepare(strategy="fsdp")`` keeps
  them too); True with several ranks, on CPU, or without that room.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

__all__ = ["SpeedSettings", "speed_settings", "TECHNIQUES"]

# the recipes' technique names -> the planner's strategy names
TECHNIQUES = {"ddp": "ddp", "single": "ddp", "fsdp2": "fsdp", "fsdp": "fsdp", "zero3": "zero3",
              "zero2": "zero2"}


@dataclass
class SpeedSettings:
    trainer_args: dict               # TrainingArguments / SFTConfig fields
    model_kwargs: dict               # from_pretrained / model-construction kwargs
    fuse_lora: bool
    reasons: dict = field(default_factory=dict)   # setting -> why
    compile_layers: bool = False     # gpulaunch.hf.compile_layers(trainer.model) before train()
    zero3_layers: bool = False       # gpulaunch.hf.zero3_layer_units(trainer.model), before that
    fsdp_config: dict = field(default_factory=dict)  # FSDP2 only: merge into fsdp_config
    notes: list = field(default_factory=list)     # advice beyond these fields (the technique)

    def __str__(self) -> str:
        rows = [*self.trainer_args.items(), *self.model_kwargs.items(),
                ("fuse_lora", self.fuse_lora), ("compile_layers", self.compile_layers),
                *([("zero3_layers", True)] if self.zero3_layers else []),
                *self.fsdp_config.items()]
        width = max(len(k) for k, _ in rows)
        return "\n".join([f"{k:<{width}}  {v!r:<22} {self.reasons.get(k, '')}" for k, v in rows]
                         + [f"note: {n}" for n in self.notes])


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _liger_supports(model_type: str | None) -> bool:
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except Exception:  # noqa: BLE001 - not installed, or its import fails without a GPU stack
        return False
    return model_type in MODEL_TYPE_TO_APPLY_LIGER_FN


# model types whose attention adds learned per-head sinks to the softmax (no SDPA/FA2 path)
SINK_MODEL_TYPES = frozenset({"gpt_oss"})


def grouped_experts(model_type: str | None) -> bool:
    """Whether the installed transformers runs this MoE model type's experts through its experts
    interface (``@use_experts_implementation``: ``grouped_mm``, its default, is one grouped GEMM
    for all experts; no data-dependent loop)."""
    if not model_type:
        return False
    try:
        import importlib

        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        from transformers.models.auto.configuration_auto import model_type_to_module_name
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        module = importlib.import_module(
            f"transformers.models.{model_type_to_module_name(model_type)}."
            f"modeling_{model_type_to_module_name(model_type)}")
        cls = getattr(module, name) if name else None
        return bool(cls is not None and "grouped_mm" in ALL_EXPERTS_FUNCTIONS
                    and cls._can_set_experts_implementation())
    except Exception:  # noqa: BLE001 - transformers 4.x, an unknown model type: not grouped
        return False


def _config_dict(model_config) -> dict | None:
    if model_config is None:
        return None
    if isinstance(model_config, dict):
        return model_config
    return model_config.to_dict()


def _needs_checkpointing(cfg: dict, *, technique: str, seq_len: int, micro_batch_size: int,
                         lora_rank, world_size: int, gpu_memory_bytes) -> tuple[bool, str]:
    """Ask the planner whether the step fits on this GPU without activation checkpointing."""
    from ..planner import plan
    from ..planner.hf_config import from_dict
    shape = from_dict(cfg)
    strategy = TECHNIQUES[technique]
    kw = dict(micro_batch_size=micro_batch_size, seq_len=seq_len, lora_rank=lora_rank,
              strategies=[strategy], gpus_per_node=world_size, gpu_memory_bytes=gpu_memory_bytes)
    plain = plan(shape, **kw).estimates[0]
    gib = 2 ** 30
    if plain.fits:
        return False, (f"planner: {plain.peak_device / gib:.1f} GiB of "
                       f"{(plain.peak_device + plain.headroom) / gib:.0f} GiB without it")
    ckpt = plan(shape, activation_checkpointing=True, **kw).estimates[0]
    return True, (f"planner: {plain.peak_device / gib:.1f} GiB without it > "
                  f"{(plain.peak_device + plain.headroom) / gib:.0f} GiB; "
                  f"{ckpt.peak_device / gib:.1f} GiB with it"
                  + ("" if ckpt.fits else " (still over: lower the micro-batch)"))


def speed_settings(model_config=None, *, device=None, technique: str = "ddp", seq_len: int = 2048,
                   micro_batch_size: int = 1, lora_rank: int | None = None, world_size: int = 1,
                   packed: bool = False, gpu_memory_bytes: int | None = None,
                   compile: bool | None = None, liger: bool | None = None,
                   gradient_checkpointing: bool | None = None,
                   adapted_experts: bool = False) -> SpeedSettings:
    """The fast settings for ``model_config`` (an HF config or its dict) trained with
    ``technique`` (ddp, fsdp2, zero3) on ``device`` (default: cuda when available).
    ``compile``/``liger``/``gradient_checkpointing``: force a choice instead of deciding it.
    ``adapted_experts``: LoRA also adapts the MoE expert parameters (peft ``target_parameters``),
    whose parametrized weights break a compiled layer's graph (the layers then stay eager)."""
    import torch
    if technique not in TECHNIQUES:
        raise ValueError(f"speed_settings(technique={technique!r}): use one of {', '.join(TECHNIQUES)}")
    device = torch.device(device if device is not None else
                          ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = device.type == "cuda"
    cfg = _config_dict(model_config)
    args, model_kwargs, why = {}, {}, {}

    bf16 = gpu and torch.cuda.is_bf16_supported()
    args["bf16"] = bf16
    why["bf16"] = "GPU with bf16" if bf16 else ("GPU without bf16" if gpu else "CPU: fp32")
    if gpu:
        args["tf32"] = True
        why["tf32"] = "any fp32 matmul left (fp32 adapters, the loss) on tensor cores"
    args["optim"] = "adamw_torch_fused" if gpu else "adamw_torch"
    why["optim"] = "one fused kernel for the AdamW step" if gpu else "CPU: the plain AdamW"

    model_type = (cfg or {}).get("model_type")
    moe = bool((cfg or {}).get("num_local_experts") or (cfg or {}).get("num_experts"))
    grouped = moe and grouped_experts(model_type)
    if grouped:
        model_kwargs["experts_implementation"] = "grouped_mm"
        why["experts_implementation"] = ("MoE: one grouped GEMM per projection for all experts, "
                                         "no Python loop over the routed experts (transformers' "
                                         "default for this model class)")
    if compile not in (None, True, False, "model", "layers"):
        raise ValueError(f"speed_settings(compile={compile!r}): use True (the decoder layers), "
                         "'model' (the trainer's whole-model torch_compile), False, or None")
    if compile is None:
        compile = gpu and (not moe or (grouped and not adapted_experts))
        why["compile_layers"] = (
            "MoE: transformers loops over experts (a graph per routing)" if gpu and moe
            and not grouped else
            "MoE with LoRA on the experts: peft's parametrized expert weights break the graph "
            "(set_/delattr in every step)" if gpu and moe and adapted_experts else
            "GPU, MoE with grouped_mm experts: no data-dependent loop, one compiled graph serves "
            "every decoder layer; hooks stay outside" if gpu and moe else
            "GPU, ZeRO-3 with each decoder layer one unit (zero3_layers): one compiled graph "
            "serves every layer; DeepSpeed's hooks stay outside" if gpu and technique == "zero3"
            else "GPU: one compiled graph serves every decoder layer; hooks stay outside" if gpu
            else "CPU: compile time outweighs the gain")
    else:
        why["compile_layers"] = "asked for"
    whole = compile == "model"
    layers = bool(compile) and not whole
    args["torch_compile"] = whole
    why["torch_compile"] = ("asked for (compile='model')" if whole else
                            "the decoder layers are compiled instead (compile_layers): the whole "
                            "model would also trace TRL's LM head, a new shape every batch"
                            if layers else "not compiling (compile_layers says why)")
    compile = bool(compile)

    if liger is None:
        liger = gpu and not compile and _liger_supports(model_type)
        why["use_liger_kernel"] = (
            "fused RMSNorm/RoPE/SwiGLU (not compiling)" if liger else
            "CPU: Liger's kernels are Triton GPU kernels" if not gpu else
            "compiled: inductor fuses RMSNorm/RoPE/SwiGLU, and Liger's Triton calls would break "
            "the graph in every layer (recompile limit)" if compile else
            "liger-kernel not installed" if not _installed("liger_kernel") else
            f"Liger has no kernels for model_type {model_type!r}")
    else:
        why["use_liger_kernel"] = "asked for"
    args["use_liger_kernel"] = bool(liger)

    sinks = model_type in SINK_MODEL_TYPES
    flash = gpu and _installed("flash_attn") and not sinks
    if sinks:
        from .sink_attention import register
        model_kwargs["attn_implementation"] = register()
        why["attn_implementation"] = (
            "attention sinks: SDPA with the sink as one more key (exact; transformers has no SDPA "
            "for it and would run eager attention, the heads x T x T scores in memory)")
    elif flash:
        model_kwargs["attn_implementation"] = "flash_attention_2"
        why["attn_implementation"] = "flash_attn installed"
    # else transformers' default: SDPA where the model has it (its flash kernel for causal rows)
    args["padding_free"] = bool(flash and not packed)
    why["padding_free"] = ("variable-length rows in one batch (FlashAttention)" if args["padding_free"]
                           else "TRL packing is padding-free already" if packed else
                           "SDPA would need a block-diagonal mask (slower than padded rows)")

    if compile and not packed and not args["padding_free"]:
        args["pad_to_multiple_of"] = 64
        why["pad_to_multiple_of"] = "compiled: near-full rows padded to one shape (no dynamic-shape graph)"

    if gradient_checkpointing is not None:
        ckpt, reason = bool(gradient_checkpointing), "asked for"
    elif not gpu:
        ckpt, reason = False, "CPU: memory is not the limit the planner models"
    elif cfg is None:
        ckpt, reason = False, "no model config to plan with"
    else:
        ckpt, reason = _needs_checkpointing(cfg, technique=technique, seq_len=seq_len,
                                            micro_batch_size=micro_batch_size, lora_rank=lora_rank,
                                            world_size=world_size, gpu_memory_bytes=gpu_memory_bytes)
    args["gradient_checkpointing"] = ckpt
    args["gradient_checkpointing_kwargs"] = {"use_reentrant": False} if ckpt else None
    why["gradient_checkpointing"] = reason
    fuse = lora_rank is not None
    why["fuse_lora"] = ("peft's adapters in the base matmul (exact)" if fuse else "not LoRA")
    fsdp_config = {}
    if TECHNIQUES[technique] == "fsdp":
        keep, why["reshard_after_forward"] = _fsdp_keep_unsharded(
            cfg, gpu=gpu, world_size=world_size, seq_len=seq_len, lora_rank=lora_rank,
            micro_batch_size=micro_batch_size, ckpt=ckpt, gpu_memory_bytes=gpu_memory_bytes)
        fsdp_config["reshard_after_forward"] = not keep
    notes = []
    if gpu and world_size == 1 and technique in ("zero3", "fsdp2", "fsdp") and cfg is not None:
        notes.append(_one_process_note(cfg, technique, seq_len=seq_len, lora_rank=lora_rank,
                                       micro_batch_size=micro_batch_size,
                                       gpu_memory_bytes=gpu_memory_bytes))
    zero3_layers = layers and technique == "zero3"
    if zero3_layers:
        why["zero3_layers"] = ("compiled under ZeRO-3: each decoder layer gathered whole by one "
                               "hook pair, none inside the compiled layer (per-submodule hooks "
                               "break its graph at every linear)")
    return SpeedSettings(args, model_kwargs, fuse, why, compile_layers=layers, notes=notes,
                         zero3_layers=zero3_layers, fsdp_config=fsdp_config)


def _fsdp_keep_unsharded(cfg, *, gpu: bool, world_size: int, ckpt: bool, **kw) -> tuple[bool, str]:
    """FSDP2 on one process: whether to keep every layer's gathered weights after forward.
    Resharding there frees only a second copy of the weights (one rank's shard is all of them)
    and costs a second gather (a copy) and its hooks per layer in backward; prepare() keeps
    them for the same reason. Only where the planner leaves room for that copy."""
    if world_size != 1:
        return False, "several ranks: each layer is resharded after forward, its memory freed"
    if not gpu:
        return False, "CPU: FSDP2 runs on GPUs only (Accelerate falls back to DDP)"
    if cfg is None:
        return False, "one process, but no model config to check the memory with"
    from ..planner import plan
    from ..planner.hf_config import from_dict
    est = plan(from_dict(cfg), strategies=["fsdp"], gpus_per_node=1,
               activation_checkpointing=ckpt, **kw).estimates[0]
    gib = 2 ** 30
    if est.headroom < est.parameters:
        return False, (f"one process, but the planner leaves {est.headroom / gib:.1f} GiB, less "
                       f"than a second copy of the weights ({est.parameters / gib:.1f} GiB)")
    return True, ("one process: resharding would free only a second copy of the weights and "
                  "gather every layer again in backward; the planner leaves "
                  f"{est.headroom / gib:.1f} GiB for the {est.parameters / gib:.1f} GiB it keeps")


def _one_process_note(cfg: dict, technique: str, **kw) -> str:
    """One process shards nothing: ZeRO-3 and FSDP only add their hooks (and, for ZeRO-3, fp32
    master weights and a gather per layer). Say so, with the planner's word on whether plain
    DDP fits."""
    from ..planner import plan
    from ..planner.hf_config import from_dict
    ddp = plan(from_dict(cfg), strategies=["ddp"], gpus_per_node=1, **kw).estimates[0]
    gib = 2 ** 30
    fits = (f"the planner puts DDP at {ddp.peak_device / gib:.1f} GiB of "
            f"{(ddp.peak_device + ddp.headroom) / gib:.0f} GiB, so technique='ddp' is the faster "
            "choice here" if ddp.fits else
            f"DDP would need {ddp.peak_device / gib:.1f} GiB (over this GPU), so keep {technique}")
    return f"one process: {technique} shards nothing and only adds its hooks; {fits}"
