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
# # Axolotl QLoRA under DDP (the seed's OLMo-3-7B notebook), through Axolotl's Python API
#
# Each rank runs `load_cfg(cfg)` → `load_datasets(cfg=cfg)` → `axolotl.train.train(cfg=...,
# dataset_meta=...)`, as the seed does: no `axolotl train` CLI, no accelerate config. Neither
# `deepspeed` nor `fsdp` is set, so Axolotl runs DDP from gpulaunch's torchrun environment.
# The config is the seed's (`examples/olmo3/olmo3-7b-qlora.yaml` adapted): 4-bit base, LoRA r 32
# / alpha 16 / dropout 0.05 on all linear layers, micro-batch 2, accumulation 4, cosine,
# lr 2e-4, warmup 10%, sample packing, 16 steps, bf16 auto, SDPA, gradient checkpointing.
#
# Where the seed's settings cannot hold, the recipe says so when it starts:
# - QLoRA's 4-bit base needs bitsandbytes on a GPU: on CPU the recipe trains plain LoRA.
# - Axolotl on CPU runs one process only (2 fail: "Cannot access accelerator device when none
#   is available"), so without GPUs the recipe runs `gpus=1`.
# - The seed's CutCrossEntropy plugin comes from a git URL, not PyPI: not used.
#
# Real length: `--data long` writes generated multi-turn chats of ~`--seq-len` tokens as JSONL
# for Axolotl to read (sample packing is then off: each row already fills a sequence);
# `--packed` turns Axolotl's sample packing on for short rows. Tokens/s, MFU and the time split
# come from the recipes' probe, which an Axolotl plugin (`llm_common.axolotl_probe`) puts in
# the trainer Axolotl builds.
#
# Needs Axolotl in its own environment: `bash scripts/recipe_venv.sh axolotl`.

# %%
import importlib.util
import os

from llm_common import options, summary

from gpulaunch import distributed
from gpulaunch import runtime as rt

os.environ.setdefault("AXOLOTL_DO_NOT_TRACK", "1")  # without it a rank can hang retrying telemetry

DEFAULTS = options.RecipeOptions(
    recipe="axolotl_qlora_ddp", arch="olmo-3-7b",
    lr=2e-4, batch_size=2, grad_accum=4, warmup_steps=0.1, max_steps=16, scheduler="cosine",
    seq_len=2048, lora_r=32, lora_alpha=16, lora_dropout=0.05, gradient_checkpointing=True,
    extra={"sample_packing": True})
TINY = dict(lr=3e-3, batch_size=8, grad_accum=1, warmup_steps=0, max_steps=40, seq_len=64,
            eval_steps=20, eval_batches=8, gradient_checkpointing=False, lora_train_modules="embed_tokens,lm_head",
            extra={"sample_packing": False})
OPTS = options.parse(DEFAULTS, TINY, description=__doc__)


def axolotl_config(opts, *, base_path: str, out_dir: str, prepared_dir: str, on_gpu: bool,
                   train_file: str, eval_file: str, sample_packing: bool):
    """The seed's Axolotl settings as a DictDefault, pointed at our model and data."""
    from axolotl.utils.dict import DictDefault
    from llm_common import sft
    chat = {"type": "chat_template", "ds_type": "json", "field_messages": "messages",
            "roles_to_train": ["assistant"], "train_on_eos": "turn"}
    cfg = {
        "base_model": base_path, "tokenizer_config": base_path,
        "load_in_4bit": on_gpu, "adapter": "qlora" if on_gpu else "lora",
        "datasets": [{"path": train_file, **chat}],
        "test_datasets": [{"path": eval_file, "split": "train", **chat}],
        "chat_template": "tokenizer_default",
        "dataset_prepared_path": prepared_dir,
        "sequence_len": opts.seq_len,
        "sample_packing": sample_packing,
        "eval_sample_packing": False,
        "lora_r": opts.lora_r, "lora_alpha": opts.lora_alpha, "lora_dropout": opts.lora_dropout,
        "lora_target_linear": True,
        # Axolotl 0.19 turns on its fused LoRA kernels by default; their patch does not match
        # Olmo3's attention in transformers 5.16 ("Original QKV code not found"): off.
        "lora_mlp_kernel": False, "lora_qkv_kernel": False, "lora_o_kernel": False,
        "lora_modules_to_save": opts.lora_train_modules.split(",") if opts.lora_train_modules else None,
        "micro_batch_size": opts.batch_size, "gradient_accumulation_steps": opts.grad_accum,
        "num_epochs": 1, "max_steps": opts.max_steps,
        "optimizer": "adamw_bnb_8bit" if on_gpu else "adamw_torch",
        "lr_scheduler": opts.scheduler, "learning_rate": opts.lr,
        "bf16": "auto" if on_gpu else False, "tf32": False,
        "gradient_checkpointing": opts.gradient_checkpointing,
        "flash_attention": False, "attn_implementation": "sdpa",
        "eval_steps": opts.eval_steps, "logging_steps": opts.logging_steps,
        "save_strategy": "no", "output_dir": out_dir, "device_map": None,
        "seed": opts.seed, "dataloader_num_workers": 0,
        "plugins": ["llm_common.axolotl_probe.ProbePlugin"],   # step timing, tokens/s, MFU
    }
    if opts.warmup_steps and opts.warmup_steps < 1:
        cfg["warmup_ratio"] = opts.warmup_steps
    else:
        cfg["warmup_steps"] = int(opts.warmup_steps)
    if sft.report_to(opts.report_to) == "mlflow":
        cfg.update(use_mlflow=True, mlflow_tracking_uri=os.environ["MLFLOW_TRACKING_URI"],
                   mlflow_run_name=opts.recipe)
    return DictDefault(cfg)


# %%
def train(opts: options.RecipeOptions) -> dict:
    import tempfile
    import time
    from pathlib import Path
    entry = time.time()

    from axolotl.cli.config import load_cfg
    from axolotl.common.datasets import load_datasets
    from axolotl.train import train as axolotl_train
    from llm_common import architectures, chat_data, chat_tokenizer, long_chat, outputs, sft

    device = rt.init()
    on_gpu = device.type == "cuda"
    if not on_gpu:
        rt.print0("NOTE: no GPU, so plain LoRA, not QLoRA (the 4-bit base needs bitsandbytes on a GPU)")
    prec = sft.precision(opts.dtype, device)
    tokenizer = chat_tokenizer.load_tokenizer(opts.model)
    out_dir = outputs.staging_dir(opts.output_path()) if rt.is_main() else tempfile.mkdtemp()
    run_tmp = Path(tempfile.gettempdir()) / f"axolotl-{os.environ.get('TORCHELASTIC_RUN_ID', 'x')}"
    base_path = opts.model
    if base_path is None:           # Axolotl loads base_model from a path: write the random base
        base_path = str(Path(out_dir) / outputs.BASE_DIR) if rt.is_main() else str(run_tmp / "base")
        if rt.is_main():
            architectures.load_model(arch_name=opts.arch, model_path=None, full=opts.full,
                                     tokenizer=tokenizer, dtype=sft.torch_dtype(prec),
                                     seed=opts.seed, layers=opts.layers,
                                     init_device=device).save_pretrained(base_path)
            tokenizer.save_pretrained(base_path)
        base_path = rt_broadcast(base_path)
    long = long_chat.is_preset(opts.data)
    if long:   # the generated chats as files; a few tokens spare for what Axolotl's template adds
        n_train, n_eval = long_chat.rows_needed(opts, rt.get_world_size())
        train_file = long_chat.cached_long_file(tokenizer, seq_len=opts.seq_len - 16,
                                                n_rows=n_train, held_out=False, seed=opts.seed)
        eval_file = opts.eval_data or long_chat.cached_long_file(
            tokenizer, seq_len=opts.seq_len - 16, n_rows=n_eval, held_out=True, seed=opts.seed + 1)
    else:
        train_file, eval_file = (opts.data or str(chat_data.TRAIN_FILE)), (opts.eval_data or str(chat_data.EVAL_FILE))
    rows = opts.max_eval_rows(rt.get_world_size())
    if rows is not None and eval_file.endswith(".jsonl"):   # a quicker eval: its first rows only
        head = run_tmp / "eval.jsonl"
        head.parent.mkdir(parents=True, exist_ok=True)
        with open(eval_file) as src, open(head, "w") as dst:
            dst.writelines(line for _, line in zip(range(rows), src))
        eval_file = str(head)
    # the seed packs samples on a GPU; rows of --data long already fill a sequence
    packing = on_gpu and (opts.packed or (bool(opts.extra.get("sample_packing")) and not long))
    cfg = axolotl_config(opts, base_path=base_path, out_dir=out_dir,
                         prepared_dir=str(run_tmp / "prepared"), on_gpu=on_gpu,
                         train_file=train_file, eval_file=eval_file, sample_packing=packing)
    cfg = load_cfg(cfg)
    dataset_meta = load_datasets(cfg=cfg)
    cfg.max_steps = opts.max_steps           # as the seed: set after load_cfg's validation
    model, tok, trainer = axolotl_train(cfg=cfg, dataset_meta=dataset_meta)
    probe = sft.find_probe(trainer)
    timeline = {"entry": entry, "train_start": probe.train_begin, "train_end": probe.train_end}
    result = sft.measured(trainer, probe, device, opts, timeline=timeline,
                          world_size=rt.get_world_size())
    if rt.is_main():
        outputs.publish(out_dir, opts.output_path())
    rt.barrier()
    import axolotl
    return sft.stamp_exit({
        **result, "technique": sft.technique_in_effect(trainer), "world_size": rt.get_world_size(),
        "framework": f"axolotl {axolotl.__version__}", "adapter": cfg.adapter,
        "load_in_4bit": bool(cfg.load_in_4bit), "sample_packing": bool(cfg.sample_packing),
        "precision": prec, "packed": bool(cfg.sample_packing),
        "eval_loss_before": result["eval_loss_before"] if result["eval_losses"][0][0] == 0 else None,
        "output": opts.output_path()})


def rt_broadcast(value):
    """Rank 0's value on every rank (a path decided by rank 0)."""
    import torch.distributed as dist
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# %%
if importlib.util.find_spec("axolotl") is None:
    raise SystemExit("axolotl_qlora_ddp needs Axolotl, which is not installed here: "
                     "`bash scripts/recipe_venv.sh axolotl`, then run this recipe with that "
                     "environment's python.")
from llm_common import launch  # noqa: E402

gpus = OPTS.gpus
if not launch.gpus_here() and (gpus or 2) > 1:
    print("NOTE: Axolotl runs one process only on CPU; running gpus=1 (DDP needs GPUs).")
    gpus = 1
results = distributed(gpus=gpus, timeout=OPTS.timeout)(train).distributed(OPTS)
result = summary.finish(OPTS, results)
