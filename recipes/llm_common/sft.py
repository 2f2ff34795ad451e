"""SFTConfig for each parallel technique, and the check that the technique really ran.

The technique travels inside ``SFTConfig`` exactly as in the seed notebooks (``deepspeed=`` a
dict, ``fsdp=``/``fsdp_config=``), with no Accelerate config file: the HF Trainer reads the
torchrun environment gpulaunch gives every rank (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR...).

Why the check: the HF Trainer decides the technique itself and does not always honour the
config. On CPU, FSDP is silently replaced by DDP (Accelerate only enables FSDP for GPU-type
devices; ``trainer.is_fsdp_enabled`` is False). So a recipe asks for a technique and then
verifies it from the trainer's state and from the wrapper actually around the model, and says
so (or refuses) when they differ.
"""

from __future__ import annotations

import os
import time

DDP, FSDP2, ZERO3 = "ddp", "fsdp2", "zero3"


class TechniqueNotInEffect(RuntimeError):
    """The Trainer is not running the parallel technique the recipe asked for."""


# --------------------------------------------------------------------------- settings
def report_to(choice: str) -> str:
    """'auto': MLflow when it is installed and a tracking URI is set (gpulaunch's tracking sets
    MLFLOW_TRACKING_URI/MLFLOW_RUN_ID in the ranks; HF's MLflowCallback then logs into that run);
    otherwise nothing, rather than a stray ./mlruns file store, which MLflow 3 refuses by default."""
    if choice != "auto":
        return choice
    try:
        import mlflow  # noqa: F401
    except ImportError:
        return "none"
    return "mlflow" if os.environ.get("MLFLOW_TRACKING_URI") else "none"


def precision(dtype_choice: str, device) -> str:
    """'bf16' or 'fp32' (DeepSpeed and autocast on CPU are exact in fp32; bf16 is GPU-only here)."""
    if dtype_choice == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    if dtype_choice not in ("bf16", "fp32"):
        raise ValueError(f"--dtype {dtype_choice!r}: use auto, bf16 or fp32")
    return dtype_choice


def torch_dtype(prec: str):
    import torch
    return torch.bfloat16 if prec == "bf16" else torch.float32


def deepspeed_zero3(*, bf16: bool) -> dict:
    """The seed notebook's ZeRO-3 dict (T/sgc-sft-trl-deepspeed-llama-1b), generated on each rank.
    ``stage3_gather_16bit_weights_on_model_save`` is what makes ``save_model`` write the full
    tensors; without it the saved safetensors hold ZeRO-3's empty placeholders."""
    return {
        "fp16": {"enabled": False},
        "bf16": {"enabled": bf16},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "none"},
            "offload_param": {"device": "none"},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "sub_group_size": 1e9,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": 0,
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
    }


def fsdp2(decoder_layer: str, *, activation_checkpointing: bool) -> tuple[str, dict]:
    """The seed notebook's FSDP2 settings (T/sgc-gpt-oss-120b-ddp-fsdp), wrap class explicit."""
    return "full_shard auto_wrap", {
        "version": 2,
        "transformer_layer_cls_to_wrap": [decoder_layer],
        "reshard_after_forward": True,
        "activation_checkpointing": activation_checkpointing,
        "state_dict_type": "FULL_STATE_DICT",   # save_model then writes one full safetensors
        "cpu_ram_efficient_loading": False,
    }


def sft_config(opts, *, technique: str, output_dir: str, device, prec: str, decoder_layer: str,
               assistant_only_loss: bool, **overrides):
    """One SFTConfig for every recipe; ``technique`` adds the seed's DeepSpeed/FSDP settings."""
    from trl import SFTConfig

    kw = dict(
        output_dir=output_dir,
        max_steps=opts.max_steps,
        per_device_train_batch_size=opts.batch_size,
        per_device_eval_batch_size=opts.batch_size,
        gradient_accumulation_steps=opts.grad_accum,
        learning_rate=opts.lr,
        warmup_steps=opts.warmup_steps,
        lr_scheduler_type=opts.scheduler,
        max_length=opts.seq_len,
        eval_strategy="steps",
        eval_steps=opts.eval_steps,
        eval_on_start=True,               # the "before" loss, inside train() (DeepSpeed needs that)
        logging_steps=opts.logging_steps,
        save_strategy="no",               # the recipe saves the final model itself, on rank 0
        seed=opts.seed,
        data_seed=opts.seed,
        bf16=prec == "bf16",
        use_cpu=device.type != "cuda",    # SFTConfig defaults to bf16, which CPU ranks refuse
        gradient_checkpointing=opts.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False} if opts.gradient_checkpointing else None,
        report_to=report_to(opts.report_to),
        run_name=opts.recipe,
        assistant_only_loss=assistant_only_loss,
        ddp_find_unused_parameters=False,
        dataloader_num_workers=0,
        dataset_num_proc=None,
        disable_tqdm=True,                # one log line per logging step instead of a bar per rank
        optim="adamw_torch",
    )
    if technique == ZERO3:
        kw["deepspeed"] = deepspeed_zero3(bf16=prec == "bf16")
    elif technique == FSDP2:
        kw["fsdp"], kw["fsdp_config"] = fsdp2(
            decoder_layer, activation_checkpointing=opts.gradient_checkpointing)
        kw["gradient_checkpointing"] = False   # FSDP does it (activation_checkpointing above)
        kw["gradient_checkpointing_kwargs"] = None
    elif technique != DDP:
        raise ValueError(f"unknown technique {technique!r}")
    kw.update(overrides)
    return SFTConfig(**kw)


# --------------------------------------------------------------------------- the check
def technique_in_effect(trainer) -> str:
    """What the trainer is actually doing: from its state, and (once training has started) from
    the wrapper around the model. 'fsdp2', 'fsdp1', 'zero<N>', 'ddp' or 'single'."""
    import torch.distributed as dist
    if trainer.is_deepspeed_enabled:
        stage = trainer.accelerator.state.deepspeed_plugin.zero_stage
        return f"zero{stage}"
    if trainer.is_fsdp_enabled:
        version = getattr(trainer.accelerator.state.fsdp_plugin, "fsdp_version", 1)
        return f"fsdp{version}"
    # Accelerate wraps in DDP whenever it runs distributed (MULTI_GPU/MULTI_CPU), world size 1 too
    kind = str(getattr(trainer.accelerator, "distributed_type", "")).upper()
    if "MULTI" in kind:
        return "ddp"
    world = dist.get_world_size() if dist.is_initialized() else 1
    return "ddp" if world > 1 else "single"


def wrapper_in_effect(trainer) -> str:
    """The wrapper around the model while it trains: proof, not configuration. (Read it during
    training; ``train_and_measure`` does, after the first step.)"""
    import torch
    m = trainer.model_wrapped
    try:
        from torch.distributed.fsdp import FSDPModule
        if isinstance(m, FSDPModule) or isinstance(trainer.model, FSDPModule):
            return "fsdp2"
    except ImportError:
        pass
    if type(m).__name__ == "DeepSpeedEngine":
        return "deepspeed"
    if isinstance(m, torch.nn.parallel.DistributedDataParallel):
        return "ddp"
    if type(m).__name__ == "FullyShardedDataParallel":
        return "fsdp1"
    return type(m).__name__


def require(trainer, wanted: str) -> str:
    """Raise TechniqueNotInEffect when the trainer will not run ``wanted``; return what it runs."""
    got = technique_in_effect(trainer)
    ok = {DDP: got in ("ddp", "single"), FSDP2: got == "fsdp2", ZERO3: got == "zero3"}[wanted]
    if not ok:
        raise TechniqueNotInEffect(
            f"Asked the HF Trainer for {wanted} but it is running {got} "
            f"(is_fsdp_enabled={trainer.is_fsdp_enabled}, "
            f"is_deepspeed_enabled={trainer.is_deepspeed_enabled}).")
    return got


# --------------------------------------------------------------------------- the run
def eval_loss(trainer) -> float:
    return float(trainer.evaluate()["eval_loss"])


def _peak_memory_gib(device) -> float:
    import torch
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def train_and_measure(trainer, device) -> dict:
    """Train, with the eval loss at the start (``eval_on_start``) and at the end, throughput and
    peak memory. Every rank must call it (evaluate and train are collective). The first eval
    runs inside ``train()`` because under DeepSpeed an ``evaluate()`` before ``train()`` builds
    an inference engine that training then cannot use."""
    import torch
    from transformers import TrainerCallback

    class Probe(TrainerCallback):
        """The wrapper seen during training (the Trainer unwraps the model when train() ends),
        and the time spent in optimizer steps alone (periodic evals excluded)."""
        seen, step_seconds, _t = None, 0.0, None

        def _now(self):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            self._t = self._now()

        def on_step_end(self, args, state, control, **kwargs):
            if self._t is not None:
                self.step_seconds += self._now() - self._t
            if self.seen is None:
                self.seen = wrapper_in_effect(trainer)

    probe = Probe()
    trainer.add_callback(probe)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    out = trainer.train()
    train_s = time.perf_counter() - t0
    logs = trainer.state.log_history
    evals = [(r["step"], r["eval_loss"]) for r in logs if "eval_loss" in r]
    if not evals or evals[-1][0] != trainer.state.global_step:
        evals.append((trainer.state.global_step, eval_loss(trainer)))
    tokens = getattr(trainer, "_total_train_tokens", 0) or max(   # TRL: all ranks, no padding
        (r.get("num_tokens", 0) for r in logs), default=0)
    return {
        "wrapper": probe.seen,
        "step_seconds": probe.step_seconds,
        "eval_loss_before": evals[0][1],
        "eval_loss_after": evals[-1][1],
        "train_loss": float(out.training_loss),
        "train_losses": [(r["step"], r["loss"]) for r in logs if "loss" in r],
        "eval_losses": evals,
        "steps": trainer.state.global_step,
        "train_seconds": train_s,
        "tokens": int(tokens),
        # tokens of all ranks (padding excluded) per second of optimizer steps (evals excluded)
        "tokens_per_second": tokens / probe.step_seconds if probe.step_seconds else None,
        "tokens_per_second_per_rank": (tokens / probe.step_seconds / trainer.args.world_size
                                       if probe.step_seconds else None),
        "peak_memory_gib": _peak_memory_gib(device),
        "memory_kind": "cuda max_memory_allocated" if device.type == "cuda" else "process max RSS",
    }
