"""DeepSpeed ZeRO-1/2/3 behind ``prepare()``: the config it generates and the engine it builds."""

from __future__ import annotations

from typing import Any

import torch

from ._env import ParallelError
from .activation_checkpoint import apply_activation_checkpointing
from .blocks import find_blocks
from .prepared import DeepSpeedPrepared

__all__ = ["deepspeed_config", "prepare_deepspeed"]


def _deep_merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def deepspeed_config(stage: int, *, mixed_precision=None, gradient_accumulation_steps: int = 1,
                     max_grad_norm: float | None = None, cpu_offload: bool = False,
                     micro_batch_size: int = 1, overrides: dict | None = None) -> dict:
    """The DeepSpeed config ``prepare()`` generates; ``overrides`` are deep-merged last."""
    zero: dict[str, Any] = {"stage": stage}
    if stage >= 2:
        zero.update(overlap_comm=False, contiguous_gradients=True)
    if stage == 3:
        # lets save_16bit_model / export gather real weights instead of writing empty ones
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if cpu_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # torch.optim optimizers are fine with ZeRO
        "zero_force_ds_cpu_optimizer": False,
        "gradient_clipping": float(max_grad_norm or 0.0),
        "steps_per_print": 2 ** 31,
        "wall_clock_breakdown": False,
    }
    if mixed_precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif mixed_precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    return _deep_merge(cfg, overrides or {})


def prepare_deepspeed(model, optimizer, strategy, device, mixed_precision, activation_checkpointing,
                      cpu_offload, gas, max_grad_norm, lr_scheduler, blocks, overrides, micro_batch_size,
                      compile_opts=None):
    try:
        import deepspeed
    except ImportError as e:
        raise ParallelError(f"strategy={strategy!r} needs DeepSpeed: pip install 'gpulaunch[deepspeed]' "
                            f"(or pip install deepspeed); import failed: {e}") from e
    stage = int(strategy[-1])
    if activation_checkpointing:
        apply_activation_checkpointing(find_blocks(model, blocks), activation_checkpointing)
    cfg = deepspeed_config(stage, mixed_precision=mixed_precision, gradient_accumulation_steps=gas,
                           max_grad_norm=max_grad_norm, cpu_offload=cpu_offload,
                           micro_batch_size=micro_batch_size, overrides=overrides)
    kwargs: dict[str, Any] = {"model": model, "config": cfg, "dist_init_required": False}
    if optimizer is not None:
        kwargs["optimizer"] = optimizer
        if not isinstance(optimizer, torch.optim.Optimizer):
            kwargs["model_parameters"] = [p for p in model.parameters() if p.requires_grad]
    if lr_scheduler is not None:
        kwargs["lr_scheduler"] = lr_scheduler
    if device.type == "cuda":
        torch.cuda.set_device(device)
    engine, _opt, _, _sched = deepspeed.initialize(**kwargs)
    if compile_opts is not None:
        # DeepSpeed compiles the wrapped module whole, in place (its ZeRO hooks stay eager); it
        # takes the backend as its own argument
        opts = dict(compile_opts)
        backend = opts.pop("backend", "inductor")
        engine.compile(backend=backend, compile_kwargs=opts)
    return DeepSpeedPrepared(strategy, engine, engine.device, mixed_precision, gas, cfg)
