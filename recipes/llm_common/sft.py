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


ZERO3_MASTERS = ("fp32", "bf16")


def deepspeed_zero3(*, bf16: bool, tuned: bool = False, on_gpu: bool = True,
                    block_numel: int | None = None, hidden_size: int | None = None,
                    compiled: bool = False, master: str = "fp32",
                    overrides: dict | None = None) -> dict:
    """The seed notebook's ZeRO-3 dict (T/sgc-sft-trl-deepspeed-llama-1b), generated on each rank.
    ``stage3_gather_16bit_weights_on_model_save`` is what makes ``save_model`` write the full
    tensors; without it the saved safetensors hold ZeRO-3's empty placeholders.

    ``tuned`` (``--speed auto``): the bucket, prefetch and persistence keys from
    ``gpulaunch.parallel.zero.zero_speed_settings`` instead of the seed's ``"auto"`` (which HF
    fills from hidden_size: buckets too small to prefetch one MLP weight) and its persistence
    threshold 0 (every norm weight partitioned and gathered twice a step). ``compiled`` (the
    layers compiled as ZeRO-3 units): ``memory_efficient_linear`` off, see
    ``gpulaunch.parallel.zero.plain_linear``.

    ``master="bf16"`` (``-x master=bf16``): DeepSpeed keeps the master weights, gradients and
    AdamW state in bf16, as the by-hand anchor and the DDP run of this recipe (a bf16 model
    under torch's fused AdamW) train, instead of fp32 copies of them. Half the optimizer's
    memory traffic and memory, and no fp32 -> bf16 copy of the weights each step; the price
    is bf16's precision for small updates, the same as those runs pay.

    ``overrides`` (``-x ds.PATH=VALUE``, ``llm_common.ds_overrides``): merged in last."""
    if master not in ZERO3_MASTERS:
        raise SystemExit(f"-x master={master!r}: use fp32 (DeepSpeed's default: fp32 master "
                         f"weights and optimizer state) or bf16 (all bf16, as the DDP run)")
    if master == "bf16" and not bf16:
        raise SystemExit("-x master=bf16 needs bf16 training (a GPU with bf16, --dtype auto or bf16)")
    seed = {
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
    if master == "bf16":
        seed["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    if tuned:
        from gpulaunch.parallel.zero import throughput_timer_off, zero_speed_settings
        seed["zero_optimization"].update(
            zero_speed_settings(3, on_gpu=on_gpu, block_numel=block_numel,
                                hidden_size=hidden_size, compiled=compiled))
        seed["timers"] = throughput_timer_off()
    if overrides:
        from gpulaunch.parallel.zero import deep_merge
        seed = deep_merge(seed, overrides)
    return seed


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


def decoder_block_numel(config) -> int | None:
    """Parameters of one decoder layer (dense Llama-style), from an HF config: what ZeRO-3
    should prefetch at once. None for MoE or unknown shapes (DeepSpeed's default then)."""
    c = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    if c.get("num_local_experts") or c.get("num_experts"):
        return None
    try:
        h, heads = c["hidden_size"], c["num_attention_heads"]
        hd = c.get("head_dim") or h // heads
        kv = c.get("num_key_value_heads") or heads
        inter = c["intermediate_size"]
    except KeyError:
        return None
    return h * hd * (2 * heads + 2 * kv) + 3 * h * inter + 2 * h


def sft_config(opts, *, technique: str, output_dir: str, device, prec: str, decoder_layer: str,
               assistant_only_loss: bool, speed_overrides: dict | None = None,
               model_config=None, zero3_compiled: bool = False, zero3_master: str = "fp32",
               zero3_overrides: dict | None = None, **overrides):
    """One SFTConfig for every recipe; ``technique`` adds the seed's DeepSpeed/FSDP settings.
    ``speed_overrides`` (llm_common.speed.apply, None with --speed off): the fast settings, and
    a tuned ZeRO-3 dict (``model_config`` gives its prefetch size; ``zero3_compiled``: the
    layers will be compiled as ZeRO-3 units, so DeepSpeed keeps torch's F.linear;
    ``zero3_overrides``: the ``-x ds.*`` keys, merged into the DeepSpeed dict last)."""
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
    if opts.packed:
        # TRL's best-fit-decreasing packing: rows fill seq_len bins, batches are padding-free
        # (one flattened row; attention stays inside each original row, see long_chat)
        kw.update(packing=True, packing_strategy="bfd")
    tuned = speed_overrides is not None
    speed = dict(speed_overrides or {})
    fsdp_speed = speed.pop("fsdp_config", {})    # merged into the FSDP2 dict below
    kw.update(speed)
    if technique == ZERO3:
        kw["deepspeed"] = deepspeed_zero3(
            bf16=prec == "bf16", tuned=tuned, on_gpu=device.type == "cuda",
            block_numel=decoder_block_numel(model_config) if model_config is not None else None,
            hidden_size=getattr(model_config, "hidden_size", None), compiled=zero3_compiled,
            master=zero3_master, overrides=zero3_overrides)
    elif technique == FSDP2:
        kw["fsdp"], kw["fsdp_config"] = fsdp2(
            decoder_layer, activation_checkpointing=opts.gradient_checkpointing)
        kw["fsdp_config"].update(fsdp_speed)
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


def peak_memory(device, seen: int = 0) -> dict:
    """``seen``: the largest CUDA peak the probe read at a step's end (a trainer that resets
    CUDA's peak at every log, as Axolotl's does, would otherwise report the last log's)."""
    import torch
    if device.type == "cuda":
        peak = max(torch.cuda.max_memory_allocated(device), seen)
        return {"peak_memory_gib": peak / 2**30,
                "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
                "memory_kind": "cuda max_memory_allocated"}
    import resource
    return {"peak_memory_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "memory_kind": "process max RSS"}   # ru_maxrss is KiB on Linux


def _tokens_so_far(trainer) -> int:
    """Tokens trained so far, all ranks, padding excluded: TRL's counter, else the HF Trainer's
    ``num_input_tokens_seen`` (``include_num_input_tokens_seen="non_padding"``)."""
    n = getattr(trainer, "_total_train_tokens", None)
    return int(n if n is not None else getattr(trainer.state, "num_input_tokens_seen", 0) or 0)


def make_probe(trainer, device):
    """A callback that times every optimizer step (CUDA-synchronised) with the tokens it
    carried, notes the wrapper seen while training (the Trainer unwraps the model when train()
    ends), and times every evaluation by wrapping ``trainer.evaluate``."""
    import torch
    from transformers import TrainerCallback

    from .token_count import BatchTokenCounter
    counter = BatchTokenCounter(trainer)

    def now():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    class Probe(TrainerCallback):
        llm_common_probe = True

        def __init__(self):
            self.seen, self.step_times, self.step_tokens = None, [], []
            self.batch_tokens = []          # this rank's, from the fetched batches (token_count)
            self.eval_seconds, self.in_train, self.eval_in_train = 0.0, False, 0.0
            self.peak_bytes = 0             # CUDA's peak at each step's end (peak_memory)
            self._t = self._tok = self.train_begin = self.train_end = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.in_train, self.train_begin = True, time.time()

        def on_train_end(self, args, state, control, **kwargs):
            self.in_train, self.train_end = False, time.time()

        def on_step_begin(self, args, state, control, **kwargs):
            self._t, self._tok = now(), _tokens_so_far(trainer)

        def on_step_end(self, args, state, control, **kwargs):
            if self._t is not None:
                self.step_times.append(now() - self._t)
                self.step_tokens.append(_tokens_so_far(trainer) - self._tok)
                self.batch_tokens.append(counter.take())
                if device.type == "cuda":
                    self.peak_bytes = max(self.peak_bytes, torch.cuda.max_memory_allocated(device))
            if self.seen is None:
                self.seen = wrapper_in_effect(trainer)

    probe = Probe()
    evaluate = trainer.evaluate

    def timed_evaluate(*a, **kw):
        t = now()
        try:
            return evaluate(*a, **kw)
        finally:
            dt = now() - t
            probe.eval_seconds += dt
            if probe.in_train:
                probe.eval_in_train += dt

    trainer.evaluate = timed_evaluate
    trainer.add_callback(probe)
    return probe


def find_probe(trainer):
    """The probe ``make_probe`` added to a trainer someone else built (Axolotl's)."""
    return next((cb for cb in trainer.callback_handler.callbacks
                 if getattr(cb, "llm_common_probe", False)), None)


def measured(trainer, probe, device, opts, *, timeline: dict, world_size: int) -> dict:
    """The numbers every recipe reports, from a finished trainer and its probe."""
    from . import metrics
    logs = trainer.state.log_history
    evals = [(r["step"], r["eval_loss"]) for r in logs if "eval_loss" in r]
    if not evals or evals[-1][0] != trainer.state.global_step:
        t = time.time()
        evals.append((trainer.state.global_step, eval_loss(trainer)))
        timeline["eval_after_s"] = time.time() - t
    tokens = _tokens_so_far(trainer) or max((r.get("num_tokens", 0) for r in logs), default=0)
    step_tokens, counted_by, extra = probe.step_tokens, "trainer", {}
    # the trainer's counter saw nothing (Unsloth's own training step) or -x token_counter=batches:
    # the tokens of the batches fetched for each step, summed over ranks (same on every rank)
    if opts.extra.get("token_counter") == "batches" or not any(probe.step_tokens):
        from .token_count import sum_over_ranks
        extra["trainer_step_tokens"] = list(probe.step_tokens)
        step_tokens, counted_by = sum_over_ranks(probe.batch_tokens, device), "batches"
        tokens = sum(step_tokens)
    steps_s = sum(probe.step_times)
    steady = metrics.steady_state(probe.step_times, step_tokens, opts.measure_after)
    per_step_capacity = opts.batch_size * opts.grad_accum * world_size * opts.seq_len
    rate = steady["steady_tokens_per_second"]
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    config = getattr(model, "config", None) or trainer.model.config
    timeline["eval_in_train_s"] = probe.eval_in_train
    return {
        "wrapper": probe.seen,
        "eval_loss_before": evals[0][1],
        "eval_loss_after": evals[-1][1],
        "eval_losses": evals,
        "train_losses": [(r["step"], r["loss"]) for r in logs if "loss" in r],
        "steps": trainer.state.global_step,
        "seq_len": opts.seq_len, "micro_batch": opts.batch_size, "grad_accum": opts.grad_accum,
        "data": opts.data or "shipped", "packed": bool(opts.packed),
        "tokens": int(tokens),
        "step_seconds": steps_s,
        "eval_seconds": probe.eval_seconds,
        "train_seconds": timeline["train_end"] - timeline["train_start"],
        # tokens of all ranks (padding excluded) per second of optimizer steps (evals excluded)
        "tokens_per_second": tokens / steps_s if steps_s else None,
        **steady,
        # real tokens per step over what micro_batch x grad_accum x ranks x seq_len could hold
        "fill": (sum(step_tokens) / (len(step_tokens) * per_step_capacity)
                 if step_tokens else None),
        "step_times": [round(t, 4) for t in probe.step_times],
        "step_tokens": step_tokens,
        "token_counter": counted_by, **extra,
        **metrics.throughput(config, seq_len=opts.seq_len, tokens_per_second=rate,
                             world_size=world_size, device=device,
                             override_tflops=opts.extra.get("peak_tflops")),
        **peak_memory(device, probe.peak_bytes), "timeline": timeline,
    }


def train_and_measure(trainer, device, opts, *, entry: float) -> dict:
    """Train, with the eval loss at the start (``eval_on_start``) and at the end, steady-state
    throughput, MFU and peak memory. Every rank must call it (evaluate and train are
    collective). The first eval runs inside ``train()`` because under DeepSpeed an
    ``evaluate()`` before ``train()`` builds an inference engine that training then cannot
    use. ``entry``: when the rank's training function started (``time.time()``)."""
    import torch
    probe = make_probe(trainer, device)
    if opts.extra.get("profile"):      # -x profile=START:COUNT (llm_common.step_profile)
        from .step_profile import make_callback
        trainer.add_callback(make_callback(
            opts.extra["profile"], opts.extra.get("profile_dir")
            or os.path.join(trainer.args.output_dir, "profile"), label=opts.recipe, device=device,
            stack=opts.extra.get("profile_stack", False)))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timeline = {"entry": entry, "train_start": time.time()}
    out = trainer.train()
    timeline["train_end"] = time.time()
    result = measured(trainer, probe, device, opts, timeline=timeline,
                      world_size=trainer.args.world_size)
    result["train_loss"] = float(out.training_loss)
    return result


def stamp_exit(result: dict) -> dict:
    """Mark the end of the rank's work (after saving and checks) in the result's timeline."""
    result["timeline"] = {**result.get("timeline", {}), "exit": time.time()}
    return result
