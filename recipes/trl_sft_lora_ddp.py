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
# # TRL SFT + LoRA under DDP (the seed's gpt-oss-20b notebook)
#
# `SFTTrainer` fine-tunes LoRA adapters (r 8, alpha 16, all linear layers) on a chat dataset,
# one process per GPU, data parallel. gpulaunch starts the processes with torchrun's
# environment, so the HF Trainer sets up DDP by itself: no `accelerate launch`, no config file.
#
# - `--model PATH`: real weights from a local directory (e.g. a download of
#   `openai/gpt-oss-20b`, loaded dequantized to bf16 as in the seed). Without it the same
#   architecture is built with random weights, tiny (CI, CPU) or at the real shape (`--full`).
# - `--data PATH`: your JSONL/Parquet with a `messages` column; default: the shipped chat set.
# - `--output PATH_OR_URL`: where rank 0 saves the adapter (and, for a random base, the base).
# - `--load-in-4bit`: QLoRA, the base's linear layers in 4 bits through bitsandbytes
#   (`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)`,
#   computing in bf16 on a GPU, fp32 on CPU), LoRA on all of them; needs `bitsandbytes`
#   (0.50.2 quantizes on CPU too). `llm_common/qlora.py` says which `--speed auto` paths stay off.
#
# As a script: `python recipes/trl_sft_lora_ddp.py --help`. As a notebook: edit `DEFAULTS`.

# %%
from llm_common import launch, options, summary

from gpulaunch import distributed
from gpulaunch import runtime as rt

DEFAULTS = options.RecipeOptions(
    recipe="trl_sft_lora_ddp", arch="gpt-oss-20b",
    # the seed's settings: lr 2e-4, micro-batch 1, accumulation 2, max_length 2048,
    # cosine_with_min_lr (min 10%), warmup 3%, non-reentrant gradient checkpointing
    lr=2e-4, batch_size=1, grad_accum=2, seq_len=2048, scheduler="cosine_with_min_lr",
    warmup_steps=0.03,
    gradient_checkpointing=True, max_steps=100, lora_r=8, lora_alpha=16, lora_dropout=0.05)
# A 200k-parameter random model needs a larger step to learn in 60 steps, and its embeddings and
# head trained with the adapters: they are random and the tokenizer is new to them (as when one
# adds tokens to a real model), so adapters alone cannot move its near-uniform predictions.
TINY = dict(lr=3e-3, warmup_steps=0, lora_train_modules="embed_tokens,lm_head", batch_size=8, grad_accum=1, seq_len=64, max_steps=60, eval_steps=30,
            gradient_checkpointing=False)
OPTS = options.parse(DEFAULTS, TINY, description=__doc__)
if OPTS.load_in_4bit:   # refused here, before any rank starts, when it cannot run
    from llm_common import qlora
    qlora.require_bitsandbytes()
    qlora.refuse_prequantized(OPTS.model)


# %% [markdown]
# ## The training function: runs on every rank

# %%
def train(opts: options.RecipeOptions) -> dict:
    import tempfile
    import time
    entry = time.time()
    from pathlib import Path

    from llm_common import architectures, chat_tokenizer, long_chat, outputs, qlora, sft, speed
    from peft import LoraConfig
    from trl import SFTTrainer

    device = rt.device()                       # cuda:<local rank>, or cpu
    prec = sft.precision(opts.dtype, device)
    quant = qlora.bnb_config(prec) if opts.load_in_4bit else None   # QLoRA: a 4-bit base
    arch = architectures.get(opts.arch)
    tokenizer = chat_tokenizer.load_tokenizer(opts.model)
    train_ds, eval_ds = long_chat.datasets_for(opts, tokenizer, rt.get_world_size())
    out_dir = outputs.staging_dir(opts.output_path()) if rt.is_main() else tempfile.mkdtemp()
    # the fast settings for this host and model (--speed off: the seed's plain ones)
    fast = speed.settings(opts, device, technique=sft.DDP, config=speed.model_config(opts, tokenizer),
                          lora=True, world_size=rt.get_world_size(), quantized=quant is not None)
    opts, speed_args, model_kwargs = speed.apply(opts, fast)

    config = sft.sft_config(
        opts, technique=sft.DDP, output_dir=out_dir, device=device, prec=prec,
        decoder_layer=arch.decoder_layer, speed_overrides=speed_args,
        assistant_only_loss="{% generation %}" in (tokenizer.chat_template or ""),
        lr_scheduler_kwargs={"min_lr_rate": 0.1} if opts.scheduler == "cosine_with_min_lr" else None)
    # DDP: each rank holds the whole model on its own GPU (the seed's device_map={"": local_rank})
    model = architectures.load_model(
        arch_name=opts.arch, model_path=opts.model, full=opts.full, tokenizer=tokenizer,
        dtype=sft.torch_dtype(prec), seed=opts.seed,
        attn_implementation=opts.attn or model_kwargs.get("attn_implementation"),
        layers=opts.layers, quantization_config=quant,
        device_map={"": device} if device.type == "cuda" else None, init_device=device)
    if opts.save and opts.model is None and rt.is_main():     # a random base must travel with its adapter
        model.save_pretrained(Path(out_dir) / outputs.BASE_DIR)   # (unquantized: the true base)
    if quant is not None and opts.model is None:   # a random base: quantized from memory
        model = qlora.quantize_random_base(model, quant, device)
    lora = LoraConfig(r=opts.lora_r, lora_alpha=opts.lora_alpha, lora_dropout=opts.lora_dropout,
                      target_modules="all-linear", bias="none", task_type="CAUSAL_LM",
                      modules_to_save=opts.lora_train_modules.split(",") if opts.lora_train_modules else None)
    trainer = SFTTrainer(model=model, args=config, train_dataset=train_ds, eval_dataset=eval_ds,
                         processing_class=tokenizer, peft_config=lora)
    technique = sft.require(trainer, sft.DDP)
    if quant is not None:
        qlora.keep_trainable_in(trainer.model, prec)    # fp32 (CPU): undo TRL's bf16 adapters
    fused = speed.fuse(trainer, fast)               # before train(): DDP wraps it there
    compiled = speed.compile_layers(trainer, fast)  # after fusing: the layers' final modules
    result = sft.train_and_measure(trainer, device, opts, entry=entry)
    if opts.save:
        trainer.save_model(out_dir)                 # rank 0 writes adapter + tokenizer
        if rt.is_main():
            outputs.publish(out_dir, opts.output_path())
    rt.barrier()
    return sft.stamp_exit({**result, "technique": technique,
            "speed": speed.summary(fast), "fused_lora": fused, "compiled_layers": compiled,
            "world_size": rt.get_world_size(), "precision": prec,
            "load_in_4bit": quant is not None,
            "quantization": qlora.describe(trainer.model) if quant is not None else None,
            "parameters": (qlora.unpacked_parameters(trainer.model) if quant is not None
                           else architectures.count_parameters(trainer.model)),
            "trainable_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
            "output": opts.output_path() if opts.save else None})


# %% [markdown]
# ## Launch on every GPU (2 CPU workers without one), then reload and generate

# %%
if launch.externally_launched():     # started by torchrun/accelerate launch: this is one rank
    results = launch.as_this_rank(train, OPTS)
else:
    results = distributed(gpus=OPTS.gpus, timeout=OPTS.timeout)(train).distributed(OPTS)
if results:
    result = summary.finish(OPTS, results)
