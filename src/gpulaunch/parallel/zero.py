"""DeepSpeed ZeRO-1/2/3 behind ``prepare()``: the config it generates and the engine it builds."""

from __future__ import annotations

from typing import Any

import torch

from ._env import ParallelError
from .activation_checkpoint import apply_activation_checkpointing
from .blocks import find_blocks
from .prepared import DeepSpeedPrepared

__all__ = ["deepspeed_config", "plain_linear", "prepare_deepspeed", "zero_speed_settings"]

# DeepSpeed's own defaults for ZeRO-3 buckets (deepspeed/runtime/zero/config.py); HF's "auto"
# replaces them with hidden_size-based values that are far smaller for a 1B model.
_REDUCE_BUCKET = int(5e8)
_PREFETCH_BUCKET = int(5e7)
_PERSISTENCE_THRESHOLD = int(1e5)


# DeepSpeed's throughput timer (on by default, ``timers.throughput.synchronized`` too) calls
# ``torch.cuda.synchronize()`` at the start of every forward and the end of every step, to time
# a samples/s figure it prints every ``steps_per_print`` steps: two drains of the GPU's queue a
# step, after which the GPU waits for the host to catch up. Nothing here reads that figure
# (trainers and the recipes time steps themselves), so the timer is off. DeepSpeed's own doc of
# the key: synchronizing "comes at the expense of performance degradation".
def throughput_timer_off() -> dict:
    """The ``timers`` section that turns it off (a new dict each call: HF fills configs in place)."""
    return {"throughput": {"enabled": False}}


def zero_speed_settings(stage: int, *, on_gpu: bool = True, block_numel: int | None = None,
                        hidden_size: int | None = None, compiled: bool = False) -> dict:
    """The ``zero_optimization`` keys that decide ZeRO-2/3 speed, each set on purpose (the values
    HF's ``"auto"`` or a ``0`` would otherwise give are what made the seed's ZeRO-3 dict slow).

    ``block_numel``: parameters of one repeated block (a decoder layer), when known: the prefetch
    bucket then holds at least the next whole block, so its all-gather overlaps this block's
    compute. ``hidden_size``, when known, sets the persistence threshold (below). ``compiled``:
    the blocks will be compiled (see ``plain_linear``)."""
    if stage < 2:
        return {}
    zero: dict[str, Any] = {
        # reduce(-scatter) gradients on a side stream while backward goes on; gloo on CPU has no
        # streams to overlap with (and the CPU path was tested without it)
        "overlap_comm": bool(on_gpu),
        # copy each gradient into one flat buffer as it is produced: no fragmentation, and the
        # reduce reads contiguous memory
        "contiguous_gradients": True,
        # DeepSpeed's default: a few large reduces a step. HF's "auto" (hidden_size^2 = 4.2 M
        # elements for Llama-3.2-1B) splits a 1B model's gradients into ~300 small ones
        "reduce_bucket_size": _REDUCE_BUCKET,
    }
    if stage == 3:
        zero.update({
            # gather the next parameters while this block computes. HF's "auto" (0.9 hidden^2 =
            # 3.8 M for 1B) is smaller than one MLP weight (16.8 M): nothing is ever prefetched
            "stage3_prefetch_bucket_size": max(_PREFETCH_BUCKET, int(1.1 * (block_numel or 0))),
            # keep small tensors (norm weights, biases) whole on every rank: partitioning them
            # costs an all-gather and two hooks each per forward and backward for a few KiB.
            # The seed's 0 partitioned every norm. 10 x hidden_size (HF's choice) keeps exactly
            # the vectors whole and partitions every matrix, also in a tiny test model;
            # DeepSpeed's default 1e5 otherwise (the same split for 1-70B models)
            "stage3_param_persistence_threshold": (10 * hidden_size if hidden_size
                                                   else _PERSISTENCE_THRESHOLD),
            # DeepSpeed's defaults, explicit: keep gathered parameters for reuse rather than
            # re-gathering them (1e9 elements is more than a 1-8B model's blocks)
            "stage3_max_live_parameters": int(1e9),
            "stage3_max_reuse_distance": int(1e9),
            # optimizer step over sub-groups of 1e9 elements: one group for models this size
            "sub_group_size": int(1e9),
        })
        if compiled:
            # torch's own F.linear, not DeepSpeed's process-wide replacement (plain_linear says
            # why); DeepSpeed turns it off itself when its own compile config is on
            zero["memory_efficient_linear"] = False
    return zero


def deep_merge(base: dict, override: dict) -> dict:
    """``base`` with ``override`` merged in, nested dicts key by key (neither is modified)."""
    out = dict(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def deepspeed_config(stage: int, *, mixed_precision=None, gradient_accumulation_steps: int = 1,
                     max_grad_norm: float | None = None, cpu_offload: bool = False,
                     micro_batch_size: int = 1, overrides: dict | None = None,
                     on_gpu: bool = True, block_numel: int | None = None,
                     compiled: bool = False) -> dict:
    """The DeepSpeed config ``prepare()`` generates; ``overrides`` are deep-merged last.
    ``on_gpu``, ``block_numel`` and ``compiled``: see ``zero_speed_settings``."""
    zero: dict[str, Any] = {"stage": stage, **zero_speed_settings(
        stage, on_gpu=on_gpu, block_numel=block_numel, compiled=compiled)}
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
        "timers": throughput_timer_off(),
    }
    if mixed_precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif mixed_precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    return deep_merge(cfg, overrides or {})


def prepare_deepspeed(model, optimizer, strategy, device, mixed_precision, activation_checkpointing,
                      cpu_offload, gas, max_grad_norm, lr_scheduler, blocks, overrides, micro_batch_size,
                      compile_opts=None):
    try:
        import deepspeed
    except ImportError as e:
        raise ParallelError(f"strategy={strategy!r} needs DeepSpeed: pip install 'gpulaunch[deepspeed]' "
                            f"(or pip install deepspeed); import failed: {e}") from e
    stage = int(strategy[-1])
    blist = find_blocks(model, blocks)
    if activation_checkpointing:
        apply_activation_checkpointing(blist, activation_checkpointing)
    units = compile_opts is not None and stage == 3 and bool(blist)
    cfg = deepspeed_config(stage, mixed_precision=mixed_precision, gradient_accumulation_steps=gas,
                           max_grad_norm=max_grad_norm, cpu_offload=cpu_offload,
                           micro_batch_size=micro_batch_size, overrides=overrides,
                           on_gpu=device.type == "cuda",
                           block_numel=max((sum(p.numel() for p in b.parameters()) for b in blist),
                                           default=None), compiled=units)
    kwargs: dict[str, Any] = {"model": model, "config": cfg, "dist_init_required": False}
    if optimizer is not None:
        kwargs["optimizer"] = optimizer
        if not isinstance(optimizer, torch.optim.Optimizer):
            kwargs["model_parameters"] = [p for p in model.parameters() if p.requires_grad]
    if lr_scheduler is not None:
        kwargs["lr_scheduler"] = lr_scheduler
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if units:
        _blocks_as_zero3_units(blist)       # before initialize: DeepSpeed reads it when hooking
    engine, _opt, _, _sched = deepspeed.initialize(**kwargs)
    if units:
        plain_linear()   # an earlier ZeRO-3 engine in this process (a warm worker) may have left it
        for block in blist:
            _compile_forward(block, compile_opts)
    elif compile_opts is not None:
        # ZeRO-1/2 hook no module: DeepSpeed compiles the wrapped module whole, in place; it
        # takes the backend as its own argument
        opts = dict(compile_opts)
        backend = opts.pop("backend", "inductor")
        engine.compile(backend=backend, compile_kwargs=opts)
    return DeepSpeedPrepared(strategy, engine, engine.device, mixed_precision, gas, cfg)


def _blocks_as_zero3_units(blist) -> None:
    """Each block one ZeRO-3 unit: DeepSpeed's leaf modules (``set_z3_leaf_modules``, by class)
    gather a block's parameters with one hook pair before its forward and backward and hook
    nothing inside it, as ``fully_shard`` does per block in FSDP2. Without it ZeRO-3 hooks
    every linear and norm, its hooks are ``torch.compiler.disable``d, and a compiled block
    breaks its graph at each of them (41 breaks, 14 graphs for a 4-layer Llama)."""
    from deepspeed.utils import set_z3_leaf_modules
    for block in blist:
        # rooted at the block: exactly these modules become units, not every module of their
        # class elsewhere in the model
        set_z3_leaf_modules(block, [type(block)])


def _compile_forward(block, compile_opts) -> None:
    """Compile the block's forward only, in place: DeepSpeed's hooks on the block run in its
    ``__call__``, outside the graph; the parameter names do not change."""
    block.forward = torch.compile(block.forward, **compile_opts)


def plain_linear() -> bool:
    """Put torch's ``F.linear`` back where DeepSpeed replaced it; True if it did.

    A ZeRO-3 engine (or ``zero.Init``) with ``memory_efficient_linear`` on, DeepSpeed's default,
    replaces ``torch.nn.functional.linear`` for the whole process with its own autograd function
    and leaves it so. That function's backward reads each weight's ``ds_id``, an int that Dynamo
    guards on: every compiled block then compiles again for its own layer, until Dynamo's
    ``recompile_limit`` (8) and the rest run eagerly (the ZeRO-3 recipe on an H100, torch 2.11:
    a recompile per layer, 0.61x the compiled full fine-tuning loop). Compiled ZeRO-3 configs
    turn the flag off (``zero_speed_settings(compiled=True)``); this undoes a replacement an
    earlier engine in the same process left (a warm worker's previous call)."""
    try:
        from deepspeed.runtime.zero.linear import zero3_linear_wrap
        from deepspeed.runtime.zero.partition_parameters import (
            InsertPostInitMethodToModuleSubClasses as _Patcher,
        )
    except ImportError:
        return False
    original = getattr(_Patcher, "linear_bk", None)
    if torch.nn.functional.linear is zero3_linear_wrap and original is not None:
        torch.nn.functional.linear = original
        return True
    return False
