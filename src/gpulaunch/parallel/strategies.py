"""``prepare()``: one call that makes a model + optimizer ready for DDP, FSDP2 or DeepSpeed ZeRO.

The returned :class:`Prepared` gives every strategy the same training loop::

    p = prepare(model, lambda params: torch.optim.AdamW(params, lr=3e-4), strategy="fsdp")
    for batch in loader:
        with p.accumulate():                  # skips needless gradient syncs between micro-batches
            loss = p.model(batch["x"], batch["y"])
            p.backward(loss)
        p.step()                              # steps only on an accumulation boundary
        p.zero_grad()

For DDP, FSDP2 and ``"none"`` plain ``loss.backward(); opt.step(); opt.zero_grad()`` on
``p.model`` / ``p.optimizer`` works too (without accumulation or fp16 loss scaling).
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable

import torch
from torch import nn

from . import _env
from ._env import ParallelError, log
from ._optim import OptimizerArg, build_optimizer, check_optimizer_arg, check_optimizer_owns
from .blocks import BlockSpec, find_blocks
from .compile import CompileArg, apply_activation_checkpointing, compile_in_place, compile_options
from .fsdp import apply_fsdp
from .prepared import DeepSpeedPrepared, Prepared, TorchPrepared  # noqa: F401 - re-exported
from .zero import deepspeed_config, prepare_deepspeed

__all__ = ["PRECISIONS", "STRATEGIES", "Prepared", "deepspeed_config", "estimate_training_bytes", "prepare"]

STRATEGIES = ("none", "ddp", "fsdp", "zero1", "zero2", "zero3", "auto")
_ALIASES = {
    "single": "none", "fsdp2": "fsdp", "fully_shard": "fsdp",
    "zero-1": "zero1", "zero-2": "zero2", "zero-3": "zero3",
    "deepspeed_zero1": "zero1", "deepspeed_zero2": "zero2", "deepspeed_zero3": "zero3",
}
_MIXED = {None: None, "no": None, "fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISIONS = (None, "fp8")


def normalize_strategy(strategy: str) -> str:
    if not isinstance(strategy, str):
        raise ParallelError(f"strategy must be a string, one of {STRATEGIES}; got {strategy!r}")
    s = strategy.strip().lower()
    s = _ALIASES.get(s, s)
    if s not in STRATEGIES:
        raise ParallelError(f"unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    return s


def estimate_training_bytes(model: nn.Module, mixed_precision: str | None = None,
                            optimizer_states: int = 2) -> int:
    """Bytes one unsharded replica needs for params + grads + Adam-like states (activations excluded).

    fp32: 4 (param) + 4 (grad) + 4*optimizer_states; bf16/fp16 autocast keeps fp32 master params,
    so the same, and activations shrink instead.
    """
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return n * (4 + 4 + 4 * optimizer_states) + frozen * 4


def _device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    import psutil

    local = int(os.environ.get("LOCAL_WORLD_SIZE", _env.world_size()))
    return psutil.virtual_memory().total // max(1, local)


def _choose_auto(model: nn.Module, device: torch.device, mixed_precision, **planner_kwargs) -> tuple[str, str]:
    world = _env.world_size()
    strategy, reason, offload_only = _choose_by_memory(model, device, mixed_precision, world, **planner_kwargs)
    if world == 1 and not offload_only:
        # One rank has nobody to replicate to or shard across: DDP, FSDP2 and ZeRO would only add
        # hooks and copies (measured: FSDP2 at world size 1 is 0.93x the plain loop compiled).
        # A sharded choice stays only where nothing fits without CPU offload, which needs it.
        tight = "" if strategy == "ddp" else (
            " -- it may not fit: consider activation_checkpointing=True, or strategy='fsdp' with "
            "cpu_offload=True")
        return "none", (f"world size 1: plain training without a wrapper (DDP, FSDP2 or ZeRO would "
                        f"only add hooks and copies on one rank){tight}; memory: {reason}")
    return strategy, reason


def _choose_by_memory(model, device, mixed_precision, world, **planner_kwargs) -> tuple[str, str, bool]:
    """(strategy, reason, whether it fits only with CPU offload)."""
    from gpulaunch.planner import choose_strategy  # ours: a failure here is a bug to see
    if choose_strategy is not None:
        # ranks per node: the launcher's LOCAL_WORLD_SIZE, else (a group built by hand) one node
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        precision = {None: "fp32", "no": "fp32", "fp32": "fp32"}.get(mixed_precision, mixed_precision)
        offered = dict(gpus_per_node=local, nodes=max(1, world // max(1, local)),
                       gpu_memory_bytes=_device_memory(device), precision=precision,
                       **planner_kwargs)
        strategy, reason = choose_strategy(model, **offered)
        base, _, offload = strategy.partition("+")   # "+offload": prepare(cpu_offload=True) is the user's call
        return normalize_strategy(base), f"planner: {reason}", bool(offload)
    need = estimate_training_bytes(model, mixed_precision)
    have = _device_memory(device)
    budget = int(0.6 * have)  # leave ~40% for activations, buffers, fragmentation
    gib = 2 ** 30
    if need <= budget:
        return "ddp", (f"params+grads+Adam states need {need / gib:.2f} GiB, within 60% of the "
                       f"{have / gib:.1f} GiB on {device}: replicate with DDP (fastest when it fits)"), False
    return "fsdp", (f"params+grads+Adam states need {need / gib:.2f} GiB, over 60% of the "
                    f"{have / gib:.1f} GiB on {device}: shard with FSDP2 "
                    f"(~{need / max(1, world) / gib:.2f} GiB per rank)"), False


def _autocast_forward(forward, device_type: str, dtype: torch.dtype):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)

    return run


def prepare(model: nn.Module, optimizer: OptimizerArg = None, strategy: str = "auto", *,
            mixed_precision: str | None = None, precision: str | None = None,
            compile: CompileArg = False, activation_checkpointing: bool = False,
            cpu_offload: bool = False, gradient_accumulation_steps: int = 1,
            max_grad_norm: float | None = None, lr_scheduler: Callable | None = None,
            blocks: BlockSpec = None, device: torch.device | None = None,
            deepspeed_config: dict | None = None, micro_batch_size: int = 1,
            ddp_kwargs: dict | None = None, fsdp_kwargs: dict | None = None,
            planner_kwargs: dict | None = None) -> Prepared:
    """Wrap ``model`` (and build ``optimizer`` on the right parameters) for ``strategy``.

    Args:
        model: a plain ``nn.Module`` (on CPU or meta-free device memory).
        optimizer: a factory ``fn(params) -> Optimizer`` (preferred), an optimizer class, or a built
            optimizer. Under FSDP2 a built optimizer is rebuilt on the sharded parameters (with a warning).
        strategy: ``"none"``, ``"ddp"``, ``"fsdp"``, ``"zero1"``, ``"zero2"``, ``"zero3"`` or ``"auto"``
            (the planner's choice; ``"none"`` at world size 1).
        mixed_precision: ``"bf16"``, ``"fp16"`` or ``None`` (fp32). DDP/none use autocast (+ GradScaler
            for fp16); FSDP2 a ``MixedPrecisionPolicy`` (fp32 gradient reduction); ZeRO DeepSpeed's own.
        precision: ``"fp8"``: the blocks' linear layers in FP8 through torchao (GPUs of compute
            capability >= 8.9; the rest in bf16; not with ZeRO). See :mod:`gpulaunch.parallel.fp8`.
        compile: ``True`` or a dict of ``torch.compile`` options: compile where each strategy gains
            most (per block before sharding for FSDP2; see :mod:`gpulaunch.parallel.compile`).
        activation_checkpointing: recompute each block's activations in backward.
        cpu_offload: FSDP2 ``CPUOffloadPolicy``; ZeRO optimizer (and ZeRO-3 parameter) offload.
        gradient_accumulation_steps: micro-batches per optimizer step; ``backward`` divides the loss.
        max_grad_norm: clip the global gradient norm before each step.
        lr_scheduler: a factory ``fn(optimizer) -> scheduler`` stepped once per optimizer step.
        blocks: FSDP2 wrap / checkpoint / compile units; default: detected (see :func:`find_blocks`).
        deepspeed_config: dict deep-merged over the generated DeepSpeed config.
    """
    strategy = normalize_strategy(strategy)
    if not isinstance(model, nn.Module):
        raise ParallelError(f"prepare() takes an nn.Module, got {type(model).__name__}")
    check_optimizer_arg(optimizer)
    if mixed_precision not in _MIXED:
        raise ParallelError(f"mixed_precision must be 'bf16', 'fp16' or None, got {mixed_precision!r}")
    if mixed_precision in ("no", "fp32"):
        mixed_precision = None
    if precision not in PRECISIONS:
        raise ParallelError(f"precision must be 'fp8' or None (use mixed_precision= for bf16/fp16), "
                            f"got {precision!r}")
    if precision == "fp8":
        if mixed_precision not in (None, "bf16"):
            raise ParallelError(f"precision='fp8' computes everything else in bf16: pass "
                                f"mixed_precision='bf16' (or leave it unset), not {mixed_precision!r}")
        mixed_precision = "bf16"
    compile_opts = compile_options(compile)
    if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
        raise ParallelError(f"gradient_accumulation_steps must be an int >= 1, got {gradient_accumulation_steps!r}")
    if lr_scheduler is not None and not callable(lr_scheduler):
        raise ParallelError("lr_scheduler must be a factory `fn(optimizer) -> scheduler`")
    if lr_scheduler is not None and isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise ParallelError("pass lr_scheduler as a factory `lambda opt: Scheduler(opt, ...)`, not a built "
                            "scheduler: the optimizer it must drive is built inside prepare()")
    device = torch.device(device) if device is not None else _env.default_device()
    if precision == "fp8":
        from .fp8 import check_fp8_hardware
        check_fp8_hardware(device)   # before anything is imported, converted or wrapped

    if strategy == "auto":
        strategy, reason = _choose_auto(model, device, mixed_precision, **(planner_kwargs or {}))
        log.info("strategy='auto' chose %r: %s", strategy, reason)
        if _env.rank() == 0:
            print(f"[gpulaunch.parallel] strategy='auto' -> {strategy!r}: {reason}", flush=True)
    if strategy.startswith("zero") and mixed_precision == "fp16" and device.type == "cpu":
        raise ParallelError(
            f"DeepSpeed does not support fp16 on CPU (its CPU accelerator refuses 'fp16'), so "
            f"strategy={strategy!r} with mixed_precision='fp16' cannot run here: use mixed_precision='bf16' "
            "or None on CPU, or run on a GPU.")
    if strategy.startswith("zero") and precision == "fp8":
        raise ParallelError(f"precision='fp8' works with strategy 'none', 'ddp' or 'fsdp', not {strategy!r}: "
                            "DeepSpeed's ZeRO does not handle torchao's float8 weights. Use strategy='fsdp' "
                            "(it shards like ZeRO-3) with precision='fp8'.")
    if strategy != "none":
        _env.require_process_group(strategy)
    if cpu_offload and strategy in ("none", "ddp"):
        raise ParallelError(f"cpu_offload=True needs strategy 'fsdp' or 'zero1/2/3', not {strategy!r}")
    if cpu_offload and device.type == "cpu":
        warnings.warn("cpu_offload=True has no effect when training on the CPU; ignoring it", stacklevel=2)
        cpu_offload = False
    if isinstance(optimizer, torch.optim.Optimizer):
        check_optimizer_owns(optimizer, model)
    # tracking hook: the chosen strategy becomes a parameter of the launch's MLflow run
    from ..tracking.inrank import record_param
    record_param("strategy", strategy)
    record_param("mixed_precision", precision or mixed_precision or "fp32")

    if strategy.startswith("zero"):
        return prepare_deepspeed(model, optimizer, strategy, device, mixed_precision, activation_checkpointing,
                                 cpu_offload, gradient_accumulation_steps, max_grad_norm, lr_scheduler,
                                 blocks, deepspeed_config, micro_batch_size, compile_opts)
    if deepspeed_config:
        raise ParallelError(f"deepspeed_config= applies to zero1/zero2/zero3, not strategy={strategy!r}")
    dtype = _MIXED[mixed_precision]

    # torchtitan's order: FP8 conversion, activation checkpointing, compilation, sharding
    after_step = []
    if precision == "fp8":
        from .fp8 import convert_to_fp8
        converted, after_step = convert_to_fp8(model, fsdp=strategy == "fsdp", blocks=blocks)
        log.info("precision='fp8': %d linear layers in FP8: %s", len(converted), ", ".join(converted))
    blist = find_blocks(model, blocks) if (strategy == "fsdp" or activation_checkpointing) else []
    if activation_checkpointing:
        if not blist:
            raise ParallelError("activation_checkpointing=True but no repeated blocks were found; pass blocks=")
        apply_activation_checkpointing(blist)

    one_rank = _env.world_size() == 1
    if strategy == "fsdp":
        if compile_opts is not None:
            for block in blist:
                compile_in_place(block, compile_opts)
        wrapped, opt = apply_fsdp(model, optimizer, device, dtype, cpu_offload, blist, fsdp_kwargs or {})
        if compile_opts is not None:   # the root's own code: embedding, head, loss
            compile_in_place(wrapped, compile_opts)
        inner = wrapped
    else:
        model.to(device)
        opt = build_optimizer(optimizer, model.parameters())
        inner = model
        if strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            kw = dict(ddp_kwargs or {})
            if device.type == "cuda":
                kw.setdefault("device_ids", [device.index])
            # gradients live in DDP's communication buckets instead of a second copy: saves 4 B/param
            kw.setdefault("gradient_as_bucket_view", True)
            inside = compile_opts is not None and one_rank
            if inside:   # nothing to overlap on one rank: the model compiled whole, as for 'none'
                if dtype is not None:
                    model.forward = _autocast_forward(model.forward, device.type, dtype)
                compile_in_place(model, compile_opts)
            wrapped = DDP(model, **kw)
            if dtype is not None and not inside:
                wrapped.forward = _autocast_forward(wrapped.forward, device.type, dtype)
            if compile_opts is not None and not inside:   # the DDP module, split at its buckets
                compile_in_place(wrapped, compile_opts)
        else:
            wrapped = model
            if dtype is not None:
                wrapped.forward = _autocast_forward(wrapped.forward, device.type, dtype)
            if compile_opts is not None:
                compile_in_place(wrapped, compile_opts)

    scaler = None
    if dtype is torch.float16 and opt is not None:
        scaler = torch.amp.GradScaler(device.type)
    sched = lr_scheduler(opt) if (lr_scheduler is not None and opt is not None) else None
    return TorchPrepared(strategy, wrapped, opt, device, mixed_precision, gradient_accumulation_steps,
                         max_grad_norm, sched, scaler, inner, after_step=after_step)
