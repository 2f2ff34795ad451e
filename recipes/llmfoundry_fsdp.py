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
# **Its own environment.** Every llm-foundry release (and mosaicml composer) pins
# `torch<2.7.1`, so it cannot share ours (torch 2.14 on CPU, 2.11 on the lent GPU):
# `bash scripts/recipe_venv.sh llmfoundry` builds one with torch 2.7.0, llm-foundry 0.22.0 and
# composer 0.32.1 (7.1 GB), and this file runs with that environment's python. Or without one:
# `bash bench/llm_foundry_bundle.sh --here` installs Foundry and what it imports with
# `--no-deps` into a directory (no torch), which goes first on `PYTHONPATH` beside a newer
# torch (trained on CPU with torch 2.14; the same tree is the lent GPU's carry).
#
# **On CPU** (2 gloo ranks): Composer's FSDP1 wrap needs CUDA (`device_id=
# torch.cuda.current_device()`), so FSDP on CPU goes through Composer's FSDP2 path
# (`FSDP_VERSION=2`, fully_shard on a CPU mesh) with fp32; `-x fsdp=off` runs DDP instead. The
# recipe reports which one wrapped the model. After training, every rank gathers the full
# weights and rank 0 checks them against the HF checkpoint `hf_checkpointer` wrote (every
# tensor present and equal), then the caller reloads it with `from_pretrained` and generates.
#
# `--data long`: generated multi-turn chats of ~`--seq-len` tokens (every response a target).

# %%
import importlib.util
import os

from llm_common import options, summary

from gpulaunch import distributed
from gpulaunch import runtime as rt

DEFAULTS = options.RecipeOptions(
    recipe="llmfoundry_fsdp", arch="llama-3.1-8b", seed=17, seq_len=1024, max_steps=20,
    batch_size=1, lr=5e-7, warmup_steps=10, gradient_checkpointing=True, eval_steps=20,
    extra={"global_batch": 32, "fsdp": "auto"})
TINY = dict(lr=3e-3, seq_len=64, batch_size=8, warmup_steps=0, max_steps=40, eval_steps=40,
            gradient_checkpointing=False, extra={"global_batch": 16, "fsdp": "auto"})
OPTS = options.parse(DEFAULTS, TINY, description=__doc__)
# torch 2.7's libuv TCPStore cannot start from an already-listening socket, which is how
# gpulaunch's rendezvous serves its store ("does not support initialization with an listen
# fd"); the legacy store can. Newer torches need nothing.
os.environ.setdefault("USE_LIBUV", "0")


def foundry_config(opts, *, model_dir: str, pretrained: bool, out_dir: str, on_gpu: bool,
                   train_file: str, eval_file: str, world_size: int, fsdp: bool) -> dict:
    """The seed's YAML as a dict, pointed at our model directory and chat JSONL."""
    def loader(path, shuffle):
        return {"name": "finetuning", "dataset": {
            "hf_name": "json", "hf_kwargs": {"data_files": path}, "split": "train",
            "max_seq_len": opts.seq_len, "decoder_only_format": True, "shuffle": shuffle,
            # every assistant turn of a multi-turn chat is a target (Foundry: the last only)
            "target_responses": "all", "target_prompts": "none",
            "packing_ratio": "auto" if on_gpu and opts.packed else None,
            "allow_pad_trimming": False},
            "drop_last": True, "num_workers": 8 if on_gpu else 0,
            # torch refuses these without worker processes
            "prefetch_factor": 2 if on_gpu else None, "persistent_workers": on_gpu}
    global_batch = max(int(opts.extra.get("global_batch", 32)), opts.batch_size * world_size)
    return {
        "seed": opts.seed, "max_seq_len": opts.seq_len, "max_duration": f"{opts.max_steps}ba",
        "global_train_batch_size": global_batch, "device_train_microbatch_size": opts.batch_size,
        "device_eval_batch_size": opts.batch_size,
        "eval_interval": f"{max(1, min(opts.eval_steps, opts.max_steps))}ba", "eval_first": True,
        "model": {"name": "hf_causal_lm", "pretrained_model_name_or_path": model_dir,
                  "pretrained": pretrained,
                  # "mixed" (rank 0 loads, FSDP syncs the others) needs the FSDP config, which
                  # Foundry itself drops at world size 1 (and then refuses "mixed")
                  "init_device": "mixed" if on_gpu and fsdp and world_size > 1 else "cpu",
                  # PyTorch SDPA, as the TRL recipes: Foundry's own default is "eager", which
                  # keeps every layer's seq x seq attention matrix (4 x 2048 tokens of
                  # Llama-3.2-1B ran out of the H100's 80 GB)
                  "use_flash_attention_2": False, "attn_implementation": "sdpa"},
        "tokenizer": {"name": model_dir, "kwargs": {"model_max_length": opts.seq_len}},
        "precision": "amp_bf16" if on_gpu else "fp32",
        "optimizer": {"name": "decoupled_lionw", "lr": opts.lr, "betas": [0.9, 0.95],
                      "weight_decay": 0.0},
        "scheduler": {"name": "linear_decay_with_warmup", "t_warmup": f"{int(opts.warmup_steps)}ba",
                      "alpha_f": 0.0},
        "algorithms": {"gradient_clipping": {"clipping_type": "norm", "clipping_threshold": 1.0}},
        "fsdp_config": {"sharding_strategy": "FULL_SHARD",
                        "mixed_precision": "PURE" if on_gpu else "FULL",
                        "state_dict_type": "sharded", "limit_all_gathers": True,
                        "activation_checkpointing": opts.gradient_checkpointing,
                        "activation_checkpointing_reentrant": False,
                        "activation_cpu_offload": False} if fsdp else None,
        "train_loader": loader(train_file, True),
        "eval_loader": loader(eval_file, False),
        "save_folder": f"{out_dir}/composer" if opts.save else None,
        "save_interval": f"{opts.max_steps}ba", "save_num_checkpoints_to_keep": 1,
        "autoresume": False, "dist_timeout": 600,
        "progress_bar": False, "log_to_console": True, "console_log_interval": "5ba",
        "callbacks": {"lr_monitor": {}, "memory_monitor": {}, "llm_common_probe": {},
                      **({"hf_checkpointer": {"save_folder": out_dir,
                                              "save_interval": f"{opts.max_steps}ba",
                                              "precision": "bfloat16" if on_gpu else "float32"}}
                         if opts.save else {})},
        "loggers": {"mlflow": {"experiment_name": opts.recipe}} if _mlflow_on(opts) else {},
    }


def _mlflow_on(opts) -> bool:
    from llm_common import sft
    return sft.report_to(opts.report_to) == "mlflow"


def fsdp_choice(opts, on_gpu: bool) -> str | None:
    """None (DDP), "1" or "2": ``-x fsdp=auto`` is the seed's FSDP1 on a GPU and Composer's
    FSDP2 on CPU (its FSDP1 wrap calls torch.cuda.current_device()); ``off``, ``1`` or ``2``
    force one."""
    choice = str(opts.extra.get("fsdp", "auto")).lower()
    if choice not in ("auto", "off", "1", "2"):
        raise ValueError(f"-x fsdp={choice!r}: use auto, off, 1 or 2")
    if choice == "off":
        return None
    return ("1" if on_gpu else "2") if choice == "auto" else choice


# %%
def train(opts: options.RecipeOptions) -> dict:
    import tempfile
    import time
    from pathlib import Path
    entry = time.time()

    import torch
    from llm_common import (
        architectures,
        chat_data,
        chat_tokenizer,
        foundry_probe,
        long_chat,
        metrics,
        outputs,
        sft,
    )
    from llmfoundry.command_utils import train as foundry_train
    from omegaconf import DictConfig

    missing = [v for v in ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                           "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:  # Composer's dist reads these; torchrun alone omits NODE_RANK
        raise RuntimeError(f"Composer needs {missing} in the environment")
    device = rt.device()
    on_gpu = device.type == "cuda"
    version = fsdp_choice(opts, on_gpu)
    fsdp = version is not None
    if fsdp:
        os.environ["FSDP_VERSION"] = version     # Composer picks its FSDP1 or FSDP2 path
    foundry_probe.register()
    tokenizer = chat_tokenizer.load_tokenizer(opts.model)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "x")
    out_dir = outputs.staging_dir(opts.output_path()) if rt.is_main() else tempfile.mkdtemp()
    model_dir, pretrained = opts.model, opts.model is not None
    if model_dir is None:    # a random model: hf_causal_lm builds it from this config.json
        model_dir = str(Path(tempfile.gettempdir()) / f"foundry-{run_id}")
        architectures.build_config(opts.arch, full=opts.full, tokenizer=tokenizer,
                                   layers=opts.layers).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    if long_chat.is_preset(opts.data):
        n_train, n_eval = long_chat.rows_needed(opts, rt.get_world_size())
        n_train = max(n_train, int(opts.extra.get("global_batch", 32)) * opts.max_steps)
        train_file = long_chat.cached_long_file(tokenizer, seq_len=opts.seq_len - 8,
                                                n_rows=n_train, held_out=False, seed=opts.seed)
        eval_file = opts.eval_data or long_chat.cached_long_file(
            tokenizer, seq_len=opts.seq_len - 8, n_rows=n_eval, held_out=True, seed=opts.seed + 1)
    else:
        train_file = opts.data or str(chat_data.TRAIN_FILE)
        eval_file = opts.eval_data or str(chat_data.EVAL_FILE)
    rows = opts.max_eval_rows(rt.get_world_size())
    if rows is not None and eval_file.endswith(".jsonl"):   # a quicker eval: its first rows only
        head = Path(tempfile.gettempdir()) / f"foundry-eval-{run_id}.jsonl"
        with open(eval_file) as src, open(head, "w") as dst:
            dst.writelines(line for _, line in zip(range(rows), src))
        eval_file = str(head)
    cfg = foundry_config(opts, model_dir=model_dir, pretrained=pretrained, out_dir=out_dir,
                         on_gpu=on_gpu, train_file=train_file, eval_file=eval_file,
                         world_size=rt.get_world_size(), fsdp=fsdp)
    if device.type == "cuda":
        # nothing has touched CUDA in this process yet (Foundry builds the model inside its
        # train()), and the allocator's statistics exist only once CUDA is initialised: without
        # this the reset fails with "Invalid device argument" (H100, torch 2.11)
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats(device)
    trainer = foundry_train(DictConfig(cfg))
    probe = foundry_probe.find(trainer)
    wrapper = wrapper_of(trainer.state.model)
    hf_model = trainer.state.model.module.model if hasattr(trainer.state.model, "module") \
        else trainer.state.model.model
    export, hf_dir = None, None
    if opts.save:
        hf_dir = newest_hf_checkpoint(out_dir) if rt.is_main() else None
        export = check_export(hf_model, hf_dir)
    # tokens of all ranks, step by step
    # on the rank's device: NCCL reduces CUDA tensors only (a CPU one: "No backend type")
    toks = torch.tensor(probe.step_tokens, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(toks)
    step_tokens = [int(t) for t in toks.tolist()]
    steady = metrics.steady_state(probe.step_times, step_tokens, opts.measure_after)
    steps_s = sum(probe.step_times)
    evals = probe.eval_losses
    if rt.is_main() and hf_dir:
        outputs.publish(out_dir, opts.output_path())
    rt.barrier()
    capacity = cfg["global_train_batch_size"] * opts.seq_len
    return sft.stamp_exit({
        "technique": wrapper if wrapper != "single" else "single",
        "wrapper": wrapper, "fsdp_version": os.environ.get("FSDP_VERSION", "1") if fsdp else None,
        "world_size": rt.get_world_size(), "precision": cfg["precision"],
        "framework": f"llm-foundry {_version('llm-foundry')}, composer {_version('mosaicml')}",
        "steps": int(trainer.state.timestamp.batch), "seq_len": opts.seq_len,
        "micro_batch": opts.batch_size, "grad_accum": cfg["global_train_batch_size"] //
        (opts.batch_size * rt.get_world_size()), "data": opts.data or "shipped",
        "eval_losses": evals, "eval_loss_before": evals[0][1] if evals else None,
        "eval_loss_after": evals[-1][1] if evals else None,
        "tokens": sum(step_tokens), "step_seconds": steps_s, "eval_seconds": probe.eval_seconds,
        "tokens_per_second": sum(step_tokens) / steps_s if steps_s else None, **steady,
        "fill": sum(step_tokens) / (len(step_tokens) * capacity) if step_tokens else None,
        "step_times": [round(t, 4) for t in probe.step_times], "step_tokens": step_tokens,
        **metrics.throughput(hf_model.config, seq_len=opts.seq_len,
                             tokens_per_second=steady["steady_tokens_per_second"],
                             world_size=rt.get_world_size(), device=device,
                             override_tflops=opts.extra.get("peak_tflops")),
        **sft.peak_memory(device),
        "parameters": sum(p.numel() for p in hf_model.parameters()),
        "export_check": export,
        "timeline": {"entry": entry, "train_start": probe.fit_begin,
                     "train_end": probe.fit_end_at, "eval_in_train_s": probe.eval_seconds},
        "output": str(Path(opts.output_path()) / Path(hf_dir).relative_to(out_dir))
        if hf_dir else None})


def wrapper_of(model) -> str:
    """What wraps Composer's model while it trains: proof, not configuration."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        FSDPModule = ()
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return "ddp"
    mods = list(model.modules())
    if FSDPModule and any(isinstance(m, FSDPModule) for m in mods):
        return "fsdp2"
    if any(isinstance(m, FullyShardedDataParallel) for m in mods):
        return "fsdp1"
    return "single"


def newest_hf_checkpoint(out_dir: str) -> str:
    """The folder hf_checkpointer wrote last (``<save_folder>/huggingface/ba<N>``)."""
    from pathlib import Path
    found = sorted(Path(out_dir, "huggingface").glob("ba*"), key=lambda p: int(p.name[2:]))
    if not found:
        raise FileNotFoundError(f"hf_checkpointer wrote nothing under {out_dir}/huggingface")
    return str(found[-1])


def check_export(hf_model, hf_dir):
    """Every rank gathers the full weights (FSDP2 DTensors: a collective); rank 0 compares them
    with the HF checkpoint's safetensors. None on the other ranks."""
    from llm_common import outputs
    named = []
    for name, p in hf_model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        named.append((name, full.detach().cpu()))
    if not rt.is_main():
        return None
    tied = {"lm_head.weight"} if getattr(hf_model.config, "tie_word_embeddings", False) else set()
    return outputs.compare_with_model(outputs.saved_tensors(hf_dir), named, tied=tied)


def _version(dist: str) -> str:
    from importlib.metadata import version
    return version(dist)


# %%
if importlib.util.find_spec("llmfoundry") is None:
    raise SystemExit(
        "llmfoundry_fsdp needs llm-foundry, which is not installed here. Every llm-foundry "
        "release (and mosaicml composer) requires torch<2.7.1, so it lives in an environment of "
        "its own: `bash scripts/recipe_venv.sh llmfoundry` (torch 2.7.0, llm-foundry 0.22.0), "
        "then run this recipe with that environment's python. Or, beside a newer torch: "
        "`bash bench/llm_foundry_bundle.sh --here` (a --no-deps tree, no torch) and that tree "
        "first on PYTHONPATH (recipes/LLM.md).")
results = distributed(gpus=OPTS.gpus, timeout=OPTS.timeout)(train).distributed(OPTS)
if results:
    check = results[0]["export_check"]
    if check is not None:
        print("export check:", {k: check[k] for k in ("ok", "tensors_compared", "max_abs_diff",
                                                      "saved_numel", "missing", "empty")})
        if not check["ok"]:
            raise SystemExit(f"the HF checkpoint is not the trained model: {check}")
    result = summary.finish(OPTS, results)
