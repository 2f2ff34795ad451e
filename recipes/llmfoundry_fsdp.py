# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # LLM Foundry full fine-tune under FSDP (the seed's Llama-3.1-8B notebook)
#
# Each rank calls `llmfoundry.command_utils.train(DictConfig(config))` directly, as the seed
# does: Composer's own launcher is bypassed, and Composer's `dist` initialises from gpulaunch's
# torchrun environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
# MASTER_PORT, and NODE_RANK, which torchrun itself does not set but gpulaunch does).
# The run config is the seed's YAML: FSDP FULL_SHARD with PURE mixed precision, sharded state
# dict, activation checkpointing (non-reentrant), amp_bf16, decoupled LionW lr 5e-7,
# linear decay with 10-batch warmup, gradient clipping 1, 20 batches, global batch 32,
# micro-batch 1, seq len 1024, seed 17, `hf_checkpointer` writing a HF model at the end.
#
# **Not runnable in this project's environments.** Every llm-foundry release (and mosaicml
# composer) pins `torch<2.7.1`; our environments have torch 2.14 (CPU/CI) and 2.11 (the lent
# GPU), so it cannot be installed beside them, and a torch-2.6 environment with CUDA wheels is
# not available offline here. The recipe is written against the documented API, and fails at
# once, clearly, when llm-foundry is missing.

# %%
import importlib.util

from gpulaunch import distributed, runtime as rt
from llm_common import options

DEFAULTS = options.RecipeOptions(
    recipe="llmfoundry_fsdp", arch="llama-3.1-8b", seed=17, seq_len=1024, max_steps=20,
    batch_size=1, lr=5e-7, warmup_steps=10, gradient_checkpointing=True,
    extra={"global_batch": 32})
TINY = dict(lr=3e-3, seq_len=64, batch_size=8, warmup_steps=0, max_steps=40,
            gradient_checkpointing=False, extra={"global_batch": 16})
OPTS = options.parse(DEFAULTS, TINY, description=__doc__)


def foundry_config(opts, *, model_dir: str, pretrained: bool, out_dir: str, on_gpu: bool,
                   train_file: str, eval_file: str, world_size: int) -> dict:
    """The seed's YAML as a dict, pointed at our model directory and chat JSONL."""
    def loader(path, shuffle):
        return {"name": "finetuning", "dataset": {
            "hf_name": "json", "hf_kwargs": {"data_files": path}, "split": "train",
            "max_seq_len": opts.seq_len, "decoder_only_format": True, "shuffle": shuffle,
            "packing_ratio": "auto" if on_gpu else None, "allow_pad_trimming": False},
            "drop_last": True, "num_workers": 8 if on_gpu else 0}
    global_batch = max(int(opts.extra.get("global_batch", 32)), opts.batch_size * world_size)
    return {
        "seed": opts.seed, "max_seq_len": opts.seq_len, "max_duration": f"{opts.max_steps}ba",
        "global_train_batch_size": global_batch, "device_train_microbatch_size": opts.batch_size,
        "device_eval_batch_size": opts.batch_size, "eval_interval": f"{max(1, opts.max_steps // 2)}ba",
        "eval_first": True,
        "model": {"name": "hf_causal_lm", "pretrained_model_name_or_path": model_dir,
                  "pretrained": pretrained, "init_device": "mixed" if on_gpu else "cpu",
                  "use_flash_attention_2": on_gpu},
        "tokenizer": {"name": model_dir, "kwargs": {"model_max_length": opts.seq_len}},
        "precision": "amp_bf16" if on_gpu else "fp32",
        "optimizer": {"name": "decoupled_lionw", "lr": opts.lr, "betas": [0.9, 0.95],
                      "weight_decay": 0.0},
        "scheduler": {"name": "linear_decay_with_warmup", "t_warmup": f"{int(opts.warmup_steps)}ba",
                      "alpha_f": 0.0},
        "algorithms": {"gradient_clipping": {"clipping_type": "norm", "clipping_threshold": 1.0}},
        "fsdp_config": {"sharding_strategy": "FULL_SHARD", "mixed_precision": "PURE",
                        "state_dict_type": "sharded", "limit_all_gathers": True,
                        "activation_checkpointing": opts.gradient_checkpointing,
                        "activation_checkpointing_reentrant": False,
                        "activation_cpu_offload": False} if on_gpu else None,
        "train_loader": loader(train_file, True),
        "eval_loader": loader(eval_file, False),
        "save_folder": f"{out_dir}/composer", "save_interval": "1h",
        "save_num_checkpoints_to_keep": 1, "autoresume": False, "dist_timeout": 600,
        "progress_bar": False, "log_to_console": True, "console_log_interval": "5ba",
        "callbacks": {"lr_monitor": {}, "speed_monitor": {"window_size": 10},
                      "memory_monitor": {}, "runtime_estimator": {},
                      "hf_checkpointer": {"save_folder": out_dir, "save_interval": f"{opts.max_steps}ba",
                                          "precision": "bfloat16" if on_gpu else "float32"}},
        "loggers": {"mlflow": {"experiment_name": opts.recipe}} if _mlflow_on(opts) else {},
    }


def _mlflow_on(opts) -> bool:
    from llm_common import sft
    return sft.report_to(opts.report_to) == "mlflow"


# %%
def train(opts: options.RecipeOptions) -> dict:
    import os
    import tempfile
    from pathlib import Path

    from omegaconf import DictConfig
    from llmfoundry.command_utils import train as foundry_train

    from llm_common import architectures, chat_data, chat_tokenizer, outputs, sft

    missing = [v for v in ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                           "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:  # Composer's dist reads these; torchrun alone omits NODE_RANK
        raise RuntimeError(f"Composer needs {missing} in the environment")
    device = rt.device()
    tokenizer = chat_tokenizer.load_tokenizer(opts.model)
    out_dir = outputs.staging_dir(opts.output_path())
    model_dir, pretrained = opts.model, opts.model is not None
    if model_dir is None:    # a random model: hf_causal_lm builds it from this config.json
        model_dir = str(Path(tempfile.gettempdir()) / f"foundry-{os.environ.get('TORCHELASTIC_RUN_ID', 'x')}")
        architectures.build_config(opts.arch, full=opts.full, tokenizer=tokenizer).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    cfg = foundry_config(opts, model_dir=model_dir, pretrained=pretrained, out_dir=out_dir,
                         on_gpu=device.type == "cuda",
                         train_file=opts.data or str(chat_data.TRAIN_FILE),
                         eval_file=opts.eval_data or str(chat_data.EVAL_FILE),
                         world_size=rt.get_world_size())
    trainer = foundry_train(DictConfig(cfg))
    if rt.is_main():
        outputs.publish(out_dir, opts.output_path())
    return {"technique": "fsdp" if cfg["fsdp_config"] else "ddp", "world_size": rt.get_world_size(),
            "steps": int(trainer.state.timestamp.batch), "output": opts.output_path(),
            "precision": cfg["precision"], "framework": "llm-foundry"}


# %%
if importlib.util.find_spec("llmfoundry") is None:
    raise SystemExit(
        "llmfoundry_fsdp needs llm-foundry, which is not installed. Every llm-foundry release "
        "(and mosaicml composer) requires torch<2.7.1, so it needs an environment of its own: "
        "python3 -m venv foundry && foundry/bin/pip install 'llm-foundry[gpu]==0.20.0' (it brings "
        "its torch), then run this recipe with foundry/bin/python. It cannot share an environment "
        "with torch 2.7.1 or later.")
results = distributed(gpus=OPTS.gpus, timeout=OPTS.timeout)(train).distributed(OPTS)
print(results[0])
