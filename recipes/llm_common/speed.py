"""The speed settings of the TRL recipes, in one place: ``--speed auto`` (default) asks
``gpulaunch.hf.speed_settings`` for this host and model (compile, Liger kernels, fused AdamW,
fused LoRA, FlashAttention when installed, gradient checkpointing only when the planner says
memory needs it, a tuned ZeRO-3 config); ``--speed off`` runs the seed's plain settings (the
loss-check baseline). ``-x compile=true|false|model``, ``-x liger=...``, ``-x fused_lora=...``,
``-x reshard_after_forward=...`` (FSDP2) force one choice (``compile=true``: the decoder
layers, ``gpulaunch.hf.compile_layers``; ``compile=model``: the trainer's whole-model
``torch_compile``); an explicit
``--gradient-checkpointing`` / ``--no-gradient-checkpointing`` wins over the planner. A compiled
run records in its result (``speed.recompile_limit_hits``) every frame Dynamo stopped compiling
after ``recompile_limit``; it should stay empty.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re

MODES = ("auto", "off")
# SFTConfig fields taken from gpulaunch.hf.speed_settings (precision stays the recipe's --dtype)
_TRAINER_FIELDS = ("tf32", "optim", "torch_compile", "use_liger_kernel", "padding_free",
                   "pad_to_multiple_of")


class _RecompileLimitHits(logging.Handler):
    """Dynamo's ``hit config.recompile_limit`` warnings: the frames it stopped compiling, which
    then run eagerly for the rest of the run (recorded in the result, ``speed``)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.functions: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if "recompile_limit" in message:
            found = re.search(r"function: '([^']+)'", message)
            self.functions.append(found.group(1) if found else message.splitlines()[0])


_HITS: _RecompileLimitHits | None = None


def _watch_recompile_limit() -> None:
    global _HITS
    if _HITS is None:
        _HITS = _RecompileLimitHits()
        logging.getLogger("torch._dynamo").addHandler(_HITS)


def model_config(opts, tokenizer):
    """The HF config of the model the recipe will build (without building it)."""
    from transformers import AutoConfig

    from . import architectures
    if opts.model:
        return AutoConfig.from_pretrained(opts.model)
    return architectures.build_config(opts.arch, full=opts.full, tokenizer=tokenizer,
                                      layers=opts.layers)


def settings(opts, device, *, technique: str, config, lora: bool, world_size: int,
             adapted_experts: bool = False, quantized: bool = False):
    """gpulaunch.hf.speed_settings for this run, or None with ``--speed off``.
    ``adapted_experts``: LoRA also adapts the MoE expert parameters. ``quantized``: the base is
    bitsandbytes 4-bit (QLoRA): compiled layers, Liger and fused LoRA stay off unless asked
    for (``llm_common.qlora.SPEED_WHY`` says why)."""
    if opts.speed not in MODES:
        raise SystemExit(f"--speed {opts.speed!r}: use one of {', '.join(MODES)}")
    if opts.speed == "off":
        return None
    from gpulaunch.hf import speed_settings
    ckpt = opts.gradient_checkpointing if "gradient_checkpointing" in opts.given else None
    compile_choice = opts.extra.get("compile")
    gpu = getattr(device, "type", str(device)) == "cuda"
    liger_choice = opts.extra.get("liger")
    if quantized and gpu:              # on CPU neither compiling nor Liger is chosen anyway
        compile_choice = False if compile_choice is None else compile_choice
        liger_choice = False if liger_choice is None else liger_choice
    s = speed_settings(config, device=device, technique=technique, seq_len=opts.seq_len,
                       micro_batch_size=opts.batch_size, lora_rank=opts.lora_r if lora else None,
                       world_size=world_size, packed=opts.packed,
                       compile=compile_choice, liger=liger_choice,
                       gradient_checkpointing=ckpt, adapted_experts=adapted_experts)
    if quantized:
        from .qlora import SPEED_WHY
        if gpu and "compile" not in opts.extra:
            s.reasons["compile_layers"] = SPEED_WHY["compile_layers"]
            s.reasons["torch_compile"] = SPEED_WHY["torch_compile"]
        if gpu and "liger" not in opts.extra:
            s.reasons["use_liger_kernel"] = SPEED_WHY["use_liger_kernel"]
        if "fused_lora" not in opts.extra:
            s.fuse_lora = False
            s.reasons["fuse_lora"] = SPEED_WHY["fuse_lora"]
    if "fused_lora" in opts.extra:
        s.fuse_lora = bool(opts.extra["fused_lora"]) and lora
        s.reasons["fuse_lora"] = "asked for"
    if reshard_choice(opts.extra) is not None and s.fsdp_config:
        s.fsdp_config["reshard_after_forward"] = reshard_choice(opts.extra)
        s.reasons["reshard_after_forward"] = "asked for"
    if s.trainer_args.get("torch_compile") or s.compile_layers:
        _watch_recompile_limit()
    if os.environ.get("RANK", "0") == "0":
        for note in s.notes:          # e.g. ZeRO-3 on one GPU: DDP is the faster choice
            print(f"speed: {note}", flush=True)
    return s


def reshard_choice(extra: dict) -> bool | None:
    """``-x reshard_after_forward=true|false`` (FSDP2, with ``--speed auto``): None when not
    given; called in the parent too, so a bad value stops the run before it starts."""
    if "reshard_after_forward" not in extra:
        return None
    value = extra["reshard_after_forward"]
    if not isinstance(value, bool):
        raise SystemExit(f"-x reshard_after_forward={value!r}: use true or false")
    return value


def apply(opts, s):
    """(opts with the planner's gradient checkpointing, SFTConfig overrides, model kwargs)."""
    if s is None:
        return opts, None, {}
    opts = dataclasses.replace(opts, gradient_checkpointing=s.trainer_args["gradient_checkpointing"])
    over = {k: s.trainer_args[k] for k in _TRAINER_FIELDS if k in s.trainer_args}
    if s.fsdp_config:                    # FSDP2's keys: sft_config merges them into its dict
        over["fsdp_config"] = dict(s.fsdp_config)
    return opts, over, dict(s.model_kwargs)


def fuse(trainer, s) -> dict | None:
    """Fuse the LoRA linears of the trainer's (not yet wrapped) peft model when asked to."""
    if s is None or not s.fuse_lora:
        return None
    from gpulaunch.hf import fuse_lora
    report = fuse_lora(trainer.model)
    return {"fused": report["fused"], "skipped": len(report["skipped"]), "mode": report["mode"]}


def compile_layers(trainer, s) -> dict | None:
    """Compile the decoder layers of the trainer's (not yet wrapped) model when the settings
    say so; after ``fuse`` (it swaps modules inside the layers)."""
    if s is None or not s.compile_layers:
        return None
    from gpulaunch.hf import compile_layers as compile_them
    units = None
    if s.zero3_layers:
        # ZeRO-3: each layer one DeepSpeed unit first, so its hooks stay outside the graph
        from gpulaunch.hf import zero3_layer_units
        units = zero3_layer_units(trainer.model)["units"]
    report = compile_them(trainer.model)
    return report if units is None else {**report, "zero3_units": units}


def summary(s) -> dict | None:
    """What the result records: every setting and why."""
    if s is None:
        return None
    values = {**s.trainer_args, **s.model_kwargs, "fuse_lora": s.fuse_lora,
              "compile_layers": s.compile_layers, "zero3_layers": s.zero3_layers,
              **s.fsdp_config}
    out = {k: {"value": v, "why": s.reasons.get(k, "")} for k, v in values.items()}
    if s.notes:
        out["notes"] = {"value": list(s.notes), "why": "advice beyond these settings"}
    if (s.trainer_args.get("torch_compile") or s.compile_layers) and _HITS is not None:
        out["recompile_limit_hits"] = {
            "value": list(_HITS.functions),
            "why": "frames Dynamo stopped compiling (eager from then on); should be empty"}
    return out
