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
# # Unsloth LoRA under DDP (the seed's Llama-3.2-3B notebook)
#
# Unsloth's `FastLanguageModel` loads the model with `device_map={"": local_rank}` (each rank
# holds the whole model on its own GPU: what DDP needs; "auto"/"balanced" would split it across
# GPUs inside one process and break DDP), adds LoRA (r 16, alpha 16, dropout 0, all seven
# projections, random_state 3407), and TRL's `SFTTrainer` trains it; gpulaunch's torchrun
# environment makes the HF Trainer run DDP. Under DDP gradient checkpointing must be
# non-reentrant (reentrant checkpointing trips DDP's "mark a variable ready only once").
#
# Needs Unsloth, which changes transformers/trl versions, so it lives in its own environment:
# `bash scripts/recipe_venv.sh unsloth` (then run this file with that venv's python). The seed's
# `train_on_responses_only` is TRL's `assistant_only_loss` here (the same masking).

# %%
from llm_common import options, summary

from gpulaunch import distributed
from gpulaunch import runtime as rt

DEFAULTS = options.RecipeOptions(
    recipe="unsloth_sft_lora_ddp", arch="llama-3.2-3b",
    # the seed's settings: micro-batch 2, accumulation 4, warmup 5, 25 steps, lr 2e-4, linear,
    # weight decay 0.01, seed 3407, max_seq_length 2048, gradient checkpointing
    lr=2e-4, batch_size=2, grad_accum=4, warmup_steps=5, max_steps=25, scheduler="linear",
    seq_len=2048, seed=3407, lora_r=16, lora_alpha=16, lora_dropout=0.0,
    gradient_checkpointing=True, eval_steps=25, logging_steps=5)
TINY = dict(lr=3e-3, batch_size=8, grad_accum=1, warmup_steps=0, max_steps=40, seq_len=64,
            eval_steps=20, logging_steps=10, gradient_checkpointing=False,
            lora_train_modules="embed_tokens,lm_head")  # why: see trl_sft_lora_ddp
OPTS = options.parse(DEFAULTS, TINY, description=__doc__)


# %%
def train(opts: options.RecipeOptions) -> dict:
    import os
    import tempfile
    import time
    entry = time.time()
    from pathlib import Path
    os.environ.setdefault("UNSLOTH_COMPILE_DISABLE", "1")   # as the seed
    import unsloth  # noqa: F401  (first: it patches transformers and trl)
    from llm_common import architectures, chat_tokenizer, long_chat, outputs, sft
    from trl import SFTTrainer
    from unsloth import FastLanguageModel

    device = rt.init()              # a group now: rank 0 writes a random base the others read
    prec = sft.precision(opts.dtype, device)
    tokenizer = chat_tokenizer.load_tokenizer(opts.model)
    train_ds, eval_ds = long_chat.datasets_for(opts, tokenizer, rt.get_world_size())
    out_dir = outputs.staging_dir(opts.output_path()) if rt.is_main() else tempfile.mkdtemp()

    base_path = opts.model
    if base_path is None:           # FastLanguageModel loads from a directory: write the random base
        base_path = str(Path(tempfile.gettempdir()) / f"unsloth-base-{os.environ.get('TORCHELASTIC_RUN_ID', 'x')}")
        if rt.is_main():
            architectures.load_model(arch_name=opts.arch, model_path=None, full=opts.full,
                                     tokenizer=tokenizer, dtype=sft.torch_dtype(prec),
                                     seed=opts.seed, layers=opts.layers,
                                     init_device=device).save_pretrained(base_path)
            tokenizer.save_pretrained(base_path)
            if opts.save:
                import shutil
                shutil.copytree(base_path, Path(out_dir) / outputs.BASE_DIR, dirs_exist_ok=True)
        rt.barrier()
    model, _ = FastLanguageModel.from_pretrained(
        base_path, max_seq_length=opts.seq_len, dtype=None if device.type == "cuda" else sft.torch_dtype(prec),
        load_in_4bit=False,
        device_map={"": rt.get_local_rank()} if device.type == "cuda" else None)
    model = FastLanguageModel.get_peft_model(
        model, r=opts.lora_r, lora_alpha=opts.lora_alpha, lora_dropout=opts.lora_dropout,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        modules_to_save=opts.lora_train_modules.split(",") if opts.lora_train_modules else None,
        use_gradient_checkpointing=opts.gradient_checkpointing, random_state=opts.seed)
    if opts.gradient_checkpointing and rt.get_world_size() > 1:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = sft.sft_config(
        opts, technique=sft.DDP, output_dir=out_dir, device=device, prec=prec,
        decoder_layer="LlamaDecoderLayer",
        assistant_only_loss="{% generation %}" in (tokenizer.chat_template or ""),
        weight_decay=0.01, optim="adamw_8bit" if device.type == "cuda" else "adamw_torch",
        gradient_checkpointing=False)   # Unsloth's own checkpointing is set on the model above
    trainer = SFTTrainer(model=model, args=config, train_dataset=train_ds, eval_dataset=eval_ds,
                         processing_class=tokenizer)
    technique = sft.require(trainer, sft.DDP)
    result = sft.train_and_measure(trainer, device, opts, entry=entry)
    if opts.save:
        trainer.save_model(out_dir)
        if rt.is_main():
            outputs.publish(out_dir, opts.output_path())
    rt.barrier()
    if opts.model is None and rt.is_main():     # the random base's files (GBs at real shape)
        import shutil
        shutil.rmtree(base_path, ignore_errors=True)
    return sft.stamp_exit({
        **result, "technique": technique, "world_size": rt.get_world_size(),
        "precision": prec, "framework": f"unsloth {unsloth.__version__}",
        "parameters": architectures.count_parameters(trainer.model),
        "trainable_parameters": sum(p.numel() for p in trainer.model.parameters()
                                    if p.requires_grad),
        "output": opts.output_path() if opts.save else None})


# %%
import importlib.util

if importlib.util.find_spec("unsloth") is None:   # fail before launching anything
    raise SystemExit("unsloth_sft_lora_ddp needs Unsloth, which is not installed here. Build its environment with "
                     "`bash scripts/recipe_venv.sh unsloth` and run this recipe with "
                     "/work/venvs/unsloth/bin/python (or `pip install unsloth` in a venv of your own).")
results = distributed(gpus=OPTS.gpus, timeout=OPTS.timeout)(train).distributed(OPTS)
result = summary.finish(OPTS, results)
