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
# # TRL SFT, full fine-tune under DeepSpeed ZeRO-3 (the seed's Llama-3.2-1B notebook)
#
# Every weight is trained; ZeRO-3 shards parameters, gradients and optimizer state across the
# ranks. The DeepSpeed config is a dict generated on each rank and handed to
# `SFTConfig(deepspeed=...)` (the seed's settings, with
# `stage3_gather_16bit_weights_on_model_save` so that `save_model` writes the full tensors rather
# than ZeRO-3's empty placeholders). After saving, every rank gathers the sharded parameters and
# rank 0 checks the saved safetensors against them: every tensor present, full-shaped, non-empty
# and equal.
#
# `-x technique=ddp` runs the same full fine-tune under plain DDP (for the loss comparison);
# `-x master=bf16` keeps ZeRO-3's master weights and AdamW state in bf16, as the DDP run does.
# `-x ds.PATH=VALUE` sets any key of the DeepSpeed dict, last (`-x ds.zero_optimization.overlap_comm=false`).
# Options: `python recipes/trl_sft_full_zero3.py --help`; `--model PATH` for real weights.

# %%
from llm_common import ds_overrides, launch, options, sft, summary

from gpulaunch import distributed
from gpulaunch import runtime as rt

DEFAULTS = options.RecipeOptions(
    recipe="trl_sft_full_zero3", arch="llama-3.2-1b",
    # the seed's settings: micro-batch 2, no accumulation, lr 2e-4, 60 steps, 10 warmup, cosine,
    # bf16, adamw_torch, no gradient checkpointing, eval every 30 steps
    lr=2e-4, batch_size=2, grad_accum=1, max_steps=60, warmup_steps=10, scheduler="cosine",
    seq_len=2048, eval_steps=30, logging_steps=10, extra={"technique": "zero3"})
TINY = dict(lr=3e-3, batch_size=8, seq_len=64, warmup_steps=0)
OPTS = options.parse(DEFAULTS, TINY, description=__doc__)
# -x master: checked here, before any process starts (the rank checks bf16 against the device)
if str(OPTS.extra.get("master", "fp32")) not in sft.ZERO3_MASTERS:
    raise SystemExit(f"-x master={OPTS.extra['master']!r}: use fp32 (DeepSpeed's default) or bf16")
if str(OPTS.extra.get("master", "fp32")) == "bf16" and OPTS.extra.get("technique", "zero3") != "zero3":
    raise SystemExit("-x master=bf16 is a ZeRO-3 setting (DeepSpeed's master weights); under "
                     "-x technique=ddp the bf16 model's own weights are trained already")
# -x ds.PATH=VALUE: the path's form, and zero_optimization keys against DeepSpeed where it imports
ds_overrides.check(OPTS.extra, technique=OPTS.extra.get("technique", "zero3"))


# %% [markdown]
# ## The training function: runs on every rank

# %%
def train(opts: options.RecipeOptions) -> dict:
    import tempfile
    import time
    entry = time.time()

    from llm_common import architectures, chat_tokenizer, long_chat, outputs, sft, speed
    from trl import SFTTrainer

    technique = opts.extra.get("technique", sft.ZERO3)
    device = rt.init()        # process group first: ZeRO-3 partitions the model as it is built
    if technique == sft.ZERO3:
        import deepspeed
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    prec = sft.precision(opts.dtype, device)
    arch = architectures.get(opts.arch)
    tokenizer = chat_tokenizer.load_tokenizer(opts.model)
    train_ds, eval_ds = long_chat.datasets_for(opts, tokenizer, rt.get_world_size())
    out_dir = outputs.staging_dir(opts.output_path()) if rt.is_main() else tempfile.mkdtemp()
    model_config = speed.model_config(opts, tokenizer)
    # the fast settings for this host and model, a tuned ZeRO-3 dict among them (--speed off:
    # the seed's plain settings and its ZeRO-3 dict)
    ds_keys = ds_overrides.from_extra(opts.extra)      # -x ds.PATH=VALUE (checked in the parent)
    fast = speed.settings(opts, device, technique=technique, config=model_config, lora=False,
                          world_size=rt.get_world_size())
    opts, speed_args, model_kwargs = speed.apply(opts, fast)

    # Real weights: SFTConfig first, so that from_pretrained loads them already partitioned
    # (deepspeed.zero.Init) and no rank ever holds the whole model. A random model is built
    # whole from the seed instead, before ZeRO-3 is configured, and partitioned when DeepSpeed
    # starts: that keeps its initial weights identical to the DDP run's (zero.Init draws the
    # random numbers in another order), which the loss comparison between techniques needs.
    def build_model():
        return architectures.load_model(
            arch_name=opts.arch, model_path=opts.model, full=opts.full, tokenizer=tokenizer,
            dtype=sft.torch_dtype(prec), seed=opts.seed,
            attn_implementation=opts.attn or model_kwargs.get("attn_implementation"),
            layers=opts.layers, init_device=device)

    def build_config():
        return sft.sft_config(opts, technique=technique, output_dir=out_dir, device=device,
                              prec=prec, decoder_layer=arch.decoder_layer,
                              speed_overrides=speed_args, model_config=model_config,
                              zero3_compiled=bool(fast and fast.compile_layers
                                                  and fast.zero3_layers),
                              zero3_master=str(opts.extra.get("master", "fp32")),
                              zero3_overrides=ds_keys,
                              assistant_only_loss="{% generation %}" in (tokenizer.chat_template or ""))

    if opts.model is not None:
        config = build_config()
        model = build_model()
    else:
        model = build_model()
        config = build_config()
    trainer = SFTTrainer(model=model, args=config, train_dataset=train_ds, eval_dataset=eval_ds,
                         processing_class=tokenizer)
    in_effect = sft.require(trainer, technique)
    # on a GPU: each decoder layer one ZeRO-3 unit (DeepSpeed hooks around it, not inside), then
    # compiled; eager on CPU and with -x compile=false
    compiled = speed.compile_layers(trainer, fast)
    result = sft.train_and_measure(trainer, device, opts, entry=entry)
    wrapper = result["wrapper"]
    unwrapped = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    named = list(unwrapped.named_parameters())
    export = None
    if opts.save:
        trainer.save_model(out_dir)   # collective under ZeRO-3: gathers 16-bit weights to rank 0
        export = check_export(named, out_dir, zero3=technique == sft.ZERO3)
        if rt.is_main():
            outputs.publish(out_dir, opts.output_path())
    rt.barrier()
    return sft.stamp_exit({
        **result, "technique": in_effect, "wrapper": wrapper, "export_check": export,
        "speed": speed.summary(fast), "compiled_layers": compiled,
        # the ZeRO settings DeepSpeed ran with, "auto" values filled in by the HF Trainer
        "deepspeed_zero": _zero_in_effect(trainer),
        "deepspeed_overrides": ds_keys or None,
        "world_size": rt.get_world_size(), "precision": prec,
        "parameters": sum(getattr(p, "ds_numel", p.numel()) for _, p in named),
        "output": opts.output_path() if opts.save else None})


def _zero_in_effect(trainer) -> dict | None:
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return None
    zero = dict(plugin.deepspeed_config.get("zero_optimization", {}))
    bf16 = plugin.deepspeed_config.get("bf16", {})
    return {**{k: v for k, v in zero.items() if not isinstance(v, dict)},
            "master": "bf16" if bf16.get("bf16_master_weights_and_grads") else "fp32",
            # DeepSpeed's throughput timer syncs the device twice a step while on (its default)
            "throughput_timer": bool(plugin.deepspeed_config.get("timers", {})
                                     .get("throughput", {}).get("enabled", True))}


def check_export(named, out_dir: str, *, zero3: bool) -> dict | None:
    """The saved safetensors against the distributed model itself: every rank gathers the
    shards (collective), rank 0 compares. None on the other ranks."""
    from llm_common import outputs
    export = None
    if zero3:
        import deepspeed
        with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
            if rt.is_main():
                export = outputs.compare_with_model(outputs.saved_tensors(out_dir), named)
    elif rt.is_main():
        export = outputs.compare_with_model(outputs.saved_tensors(out_dir), named)
    if export is not None:
        export["model_numel"] = sum(getattr(p, "ds_numel", p.numel()) for _, p in named)
    return export


# %% [markdown]
# ## Launch, check the export, reload and generate

# %%
if launch.externally_launched():     # started by torchrun/accelerate launch: this is one rank
    results = launch.as_this_rank(train, OPTS)
else:
    results = distributed(gpus=OPTS.gpus, timeout=OPTS.timeout)(train).distributed(OPTS)
if results:
    check = results[0]["export_check"]
    if check is not None:                   # None: not saved (-x save=false)
        print("export check:", {k: check[k] for k in ("ok", "tensors_compared", "max_abs_diff",
                                                      "saved_numel", "model_numel", "missing",
                                                      "empty")})
        if not check["ok"]:
            raise SystemExit(f"the saved weights are not the trained model's: {check}")
    result = summary.finish(OPTS, results)
