# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # TRL SFT + LoRA under FSDP2 (the seed's gpt-oss-120b notebook)
#
# LoRA r 32 / alpha 32 on all linear layers, and on the MoE expert weights too (rank 8, through
# PEFT's `target_parameters`), with the model sharded by FSDP2: `SFTConfig(fsdp="full_shard
# auto_wrap", fsdp_config={"version": 2, ...})`, one FSDP unit per decoder layer, no device_map
# (placement is FSDP's), `model.to(bfloat16)` after wrapping so FSDP sees one dtype.
#
# **GPU only, and checked.** The HF Trainer enables FSDP only on GPU-type devices: on CPU,
# Accelerate silently wraps the model in DDP instead (`trainer.is_fsdp_enabled` is False) and
# the run would look like an FSDP run while being a DDP one. So this recipe verifies
# `trainer.is_fsdp_enabled` and the wrapper actually around the model, and on a machine without
# GPUs it refuses before starting anything. `-x on_cpu=ddp` runs the same job on CPU anyway,
# labelled DDP everywhere (banner, result, `technique`), never FSDP. (For FSDP2 that does shard on
# CPU, use `gpulaunch.parallel.prepare(model, strategy="fsdp")` with your own loop.)
#
# FSDP at world size 1 is real FSDP too (`--gpus 1`), which is how it is measured on one H200.

# %%
from llm_common import launch, options, speed, summary

from gpulaunch import distributed
from gpulaunch import runtime as rt

DEFAULTS = options.RecipeOptions(
    recipe="trl_sft_lora_fsdp", arch="gpt-oss-120b",
    # the seed's settings: LoRA r 32 / alpha 32 / dropout 0, experts r 8; max_length 2048,
    # micro-batch 1, accumulation 4, lr 1.5e-4, warmup 3%, cosine, bf16, logging every 5,
    # FSDP activation checkpointing on (Trainer gradient checkpointing off)
    lr=1.5e-4, batch_size=1, grad_accum=4, seq_len=2048, warmup_steps=0.03, scheduler="cosine",
    logging_steps=5, max_steps=100, lora_r=32, lora_alpha=32, lora_dropout=0.0,
    gradient_checkpointing=True, extra={"expert_rank": 8, "on_cpu": "refuse"})
TINY = dict(lr=3e-3, warmup_steps=0, batch_size=8, grad_accum=1, seq_len=64, max_steps=60,
            logging_steps=10, gradient_checkpointing=False,
            lora_train_modules="embed_tokens,lm_head")  # why: see trl_sft_lora_ddp
OPTS = options.parse(DEFAULTS, TINY, description=__doc__)
speed.reshard_choice(OPTS.extra)   # -x reshard_after_forward=true|false: checked here, early


# %% [markdown]
# ## Refuse early on a machine without GPUs (unless asked to run it as DDP)

# %%
class FSDPNeedsGPU(RuntimeError):
    pass


def check_fsdp_possible(opts) -> bool:
    """True when FSDP can be real here; raises (default) or warns when it cannot."""
    if launch.gpus_here():
        return True
    if opts.extra.get("on_cpu", "refuse") != "ddp":
        raise FSDPNeedsGPU(
            "trl_sft_lora_fsdp needs GPUs: this machine has none, and on CPU the HF Trainer "
            "silently replaces FSDP with DDP (Accelerate enables FSDP only for GPU devices; "
            "trainer.is_fsdp_enabled stays False). Refusing to report a DDP run as FSDP. Options: "
            "run on a GPU machine (FSDP2 works at --gpus 1 too); pass -x on_cpu=ddp to run this "
            "job under DDP, labelled as DDP; or shard on CPU with "
            "gpulaunch.parallel.prepare(model, strategy='fsdp') in your own training loop.")
    print("=" * 78 + "\nNO GPU: FSDP IS NOT POSSIBLE HERE. Running under DDP (-x on_cpu=ddp); "
          "the results say technique=ddp.\n" + "=" * 78, flush=True)
    return False


FSDP_POSSIBLE = check_fsdp_possible(OPTS)


# %% [markdown]
# ## The training function: runs on every rank

# %%
def train(opts: options.RecipeOptions) -> dict:
    import tempfile
    import time
    entry = time.time()
    from pathlib import Path

    from llm_common import architectures, chat_tokenizer, long_chat, outputs, sft, speed
    from peft import LoraConfig
    from trl import SFTTrainer

    device = rt.device()
    prec = sft.precision(opts.dtype, device)
    arch = architectures.get(opts.arch)
    tokenizer = chat_tokenizer.load_tokenizer(opts.model)
    train_ds, eval_ds = long_chat.datasets_for(opts, tokenizer, rt.get_world_size())
    out_dir = outputs.staging_dir(opts.output_path()) if rt.is_main() else tempfile.mkdtemp()
    # the fast settings for this host and model (--speed off: the seed's plain ones)
    fast = speed.settings(opts, device, technique=sft.FSDP2 if device.type == "cuda" else sft.DDP, config=speed.model_config(opts, tokenizer),
                          lora=True, world_size=rt.get_world_size(),
                          adapted_experts=bool(arch.lora_expert_parameters))
    opts, speed_args, model_kwargs = speed.apply(opts, fast)
    config = sft.sft_config(opts, technique=sft.FSDP2, output_dir=out_dir, device=device,
                            prec=prec, decoder_layer=arch.decoder_layer,
                            speed_overrides=speed_args,
                            assistant_only_loss="{% generation %}" in (tokenizer.chat_template or ""))
    model = architectures.load_model(   # no device_map for real weights: FSDP places the shards
        arch_name=opts.arch, model_path=opts.model, full=opts.full, tokenizer=tokenizer,
        dtype=sft.torch_dtype(prec), seed=opts.seed,
        attn_implementation=opts.attn or model_kwargs.get("attn_implementation"),
        layers=opts.layers,
        init_device=device)
    if opts.save and opts.model is None and rt.is_main():
        model.save_pretrained(Path(out_dir) / outputs.BASE_DIR)
    experts = list(arch.lora_expert_parameters)
    lora = LoraConfig(
        r=opts.lora_r, lora_alpha=opts.lora_alpha, lora_dropout=opts.lora_dropout,
        target_modules="all-linear", target_parameters=experts or None,
        rank_pattern={e: int(opts.extra.get("expert_rank", 8)) for e in experts},
        bias="none", task_type="CAUSAL_LM",
        modules_to_save=opts.lora_train_modules.split(",") if opts.lora_train_modules else None)
    trainer = SFTTrainer(model=model, args=config, train_dataset=train_ds, eval_dataset=eval_ds,
                         processing_class=tokenizer, peft_config=lora)
    trainer.model.to(sft.torch_dtype(prec))     # one dtype for FSDP (the seed does the same)
    try:
        technique = sft.require(trainer, sft.FSDP2)
    except sft.TechniqueNotInEffect as e:
        if device.type == "cuda" or opts.extra.get("on_cpu") != "ddp":
            raise
        technique = sft.technique_in_effect(trainer)
        rt.print0(f"NOT FSDP: {e} Continuing as {technique} because -x on_cpu=ddp.")
    fused = speed.fuse(trainer, fast)               # before train(): FSDP2 wraps it there
    compiled = speed.compile_layers(trainer, fast)  # after fusing: the layers' final modules
    result = sft.train_and_measure(trainer, device, opts, entry=entry)
    wrapper = result["wrapper"]
    if technique == "fsdp2" and wrapper != "fsdp2":
        raise sft.TechniqueNotInEffect(f"the Trainer reported FSDP2 but wrapped the model in {wrapper}")
    if opts.save:
        trainer.save_model(out_dir)                 # FULL_STATE_DICT: rank 0 writes the adapter
        if rt.is_main():
            outputs.publish(out_dir, opts.output_path())
    rt.barrier()
    return sft.stamp_exit({**result, "technique": technique, "wrapper": wrapper,
            "speed": speed.summary(fast), "fused_lora": fused, "compiled_layers": compiled,
            "fsdp_enabled": bool(trainer.is_fsdp_enabled), "world_size": rt.get_world_size(),
            "precision": prec, "parameters": architectures.count_parameters(trainer.model),
            "trainable_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
            "output": opts.output_path() if opts.save else None})


# %% [markdown]
# ## Launch, then reload and generate

# %%
if launch.externally_launched():     # started by torchrun/accelerate launch: this is one rank
    results = launch.as_this_rank(train, OPTS)
else:
    results = distributed(gpus=OPTS.gpus, timeout=OPTS.timeout)(train).distributed(OPTS)
if results:
    result = summary.finish(OPTS, results)
