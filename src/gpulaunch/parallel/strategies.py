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

import contextlib
import functools
import inspect
import warnings
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from . import _env
from ._env import ParallelError, log
from .blocks import BlockSpec, find_blocks

__all__ = ["prepare", "Prepared", "STRATEGIES", "estimate_training_bytes", "deepspeed_config"]

STRATEGIES = ("none", "ddp", "fsdp", "zero1", "zero2", "zero3", "auto")
_ALIASES = {
    "single": "none", "fsdp2": "fsdp", "fully_shard": "fsdp",
    "zero-1": "zero1", "zero-2": "zero2", "zero-3": "zero3",
    "deepspeed_zero1": "zero1", "deepspeed_zero2": "zero2", "deepspeed_zero3": "zero3",
}
_MIXED = {None: None, "no": None, "fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

OptimizerArg = Union[None, torch.optim.Optimizer, Callable[..., torch.optim.Optimizer]]


def normalize_strategy(strategy: str) -> str:
    if not isinstance(strategy, str):
        raise ParallelError(f"strategy must be a string, one of {STRATEGIES}; got {strategy!r}")
    s = strategy.strip().lower()
    s = _ALIASES.get(s, s)
    if s not in STRATEGIES:
        raise ParallelError(f"unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    return s


def estimate_training_bytes(model: nn.Module, mixed_precision: Optional[str] = None,
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
    import os

    import psutil

    local = int(os.environ.get("LOCAL_WORLD_SIZE", _env.world_size()))
    return psutil.virtual_memory().total // max(1, local)


def _choose_auto(model: nn.Module, device: torch.device, mixed_precision, **planner_kwargs) -> tuple[str, str]:
    try:
        from gpulaunch.planner import choose_strategy  # type: ignore
    except ImportError:
        choose_strategy = None
    if choose_strategy is not None:
        import os
        world = _env.world_size()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        precision = {None: "fp32", "no": "fp32", "fp32": "fp32"}.get(mixed_precision, mixed_precision)
        offered = dict(gpus_per_node=local, nodes=max(1, world // max(1, local)),
                       gpu_memory_bytes=_device_memory(device), precision=precision,
                       **planner_kwargs)
        strategy, reason = choose_strategy(model, **offered)
        strategy = strategy.split("+", 1)[0]   # "+offload": prepare(cpu_offload=True) is the user's call
        return normalize_strategy(strategy), f"planner: {reason}"
    need = estimate_training_bytes(model, mixed_precision)
    have = _device_memory(device)
    budget = int(0.6 * have)  # leave ~40% for activations, buffers, fragmentation
    gib = 2 ** 30
    if need <= budget:
        return "ddp", (f"params+grads+Adam states need {need / gib:.2f} GiB, within 60% of the "
                       f"{have / gib:.1f} GiB on {device}: replicate with DDP (fastest when it fits)")
    return "fsdp", (f"params+grads+Adam states need {need / gib:.2f} GiB, over 60% of the "
                    f"{have / gib:.1f} GiB on {device}: shard with FSDP2 "
                    f"(~{need / max(1, _env.world_size()) / gib:.2f} GiB per rank)")


def _check_optimizer_arg(optimizer: OptimizerArg) -> None:
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer) or callable(optimizer):
        return
    raise ParallelError(
        f"optimizer must be a torch.optim.Optimizer or a factory `fn(params) -> Optimizer` "
        f"(e.g. `lambda ps: torch.optim.AdamW(ps, lr=1e-3)`), got {type(optimizer).__name__}")


def _build_optimizer(optimizer: OptimizerArg, params) -> Optional[torch.optim.Optimizer]:
    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    opt = optimizer(params)
    if not isinstance(opt, torch.optim.Optimizer):
        raise ParallelError(f"the optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer")
    return opt


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}


def _check_optimizer_owns(opt: torch.optim.Optimizer, model: nn.Module) -> None:
    mine = {id(p) for p in model.parameters()}
    foreign = sum(1 for g in opt.param_groups for p in g["params"] if id(p) not in mine)
    if foreign:
        raise ParallelError(
            f"the optimizer holds {foreign} parameter(s) that are not this model's (built on another "
            "model or a copy?). Pass a factory `lambda params: Opt(params, ...)` so prepare() builds it.")


def _autocast_forward(forward, device_type: str, dtype: torch.dtype):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)

    return run


def _apply_activation_checkpointing(blocks: list[nn.Module]) -> None:
    from torch.utils.checkpoint import checkpoint

    for block in blocks:
        inner = block.forward  # bound method; the instance attribute below shadows the class's forward

        def ckpt_forward(*args, __inner=inner, **kwargs):
            return checkpoint(__inner, *args, use_reentrant=False, **kwargs)

        block.forward = ckpt_forward


def _deep_merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def deepspeed_config(stage: int, *, mixed_precision=None, gradient_accumulation_steps: int = 1,
                     max_grad_norm: Optional[float] = None, cpu_offload: bool = False,
                     micro_batch_size: int = 1, overrides: Optional[dict] = None) -> dict:
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


class Prepared:
    """A model and optimizer made ready for one strategy, with a loop API that works for all.

    Attributes: ``model`` (call it for forward), ``optimizer``, ``strategy``, ``device``,
    ``mixed_precision``, ``gradient_accumulation_steps``, ``lr_scheduler``.
    """

    strategy: str
    model: nn.Module
    optimizer: Optional[torch.optim.Optimizer]
    lr_scheduler: Any = None

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self) -> bool:
        """Optimizer step on an accumulation boundary (returns True then), else only counts."""
        raise NotImplementedError

    def zero_grad(self) -> None:
        raise NotImplementedError

    def accumulate(self):
        """Context for one micro-batch's forward+backward; skips gradient sync unless it is the last."""
        raise NotImplementedError

    def unwrap(self) -> nn.Module:
        """The user's own module (under FSDP2 / ZeRO-3 its parameters are sharded)."""
        raise NotImplementedError

    @property
    def sync_gradients(self) -> bool:
        """True when the next ``step()`` is an accumulation boundary."""
        return (self._micro + 1) % self.gradient_accumulation_steps == 0

    def __repr__(self):
        return (f"Prepared(strategy={self.strategy!r}, device={self.device}, "
                f"mixed_precision={self.mixed_precision!r}, "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps})")


class TorchPrepared(Prepared):
    """``none``, ``ddp`` and ``fsdp``: plain torch optimizer, our own accumulation and loss scaling."""

    def __init__(self, strategy, model, optimizer, device, mixed_precision, gas, max_grad_norm,
                 lr_scheduler, scaler, inner):
        self.strategy, self.model, self.optimizer, self.device = strategy, model, optimizer, device
        self.mixed_precision, self.gradient_accumulation_steps = mixed_precision, gas
        self.max_grad_norm, self.lr_scheduler, self.scaler, self._inner = max_grad_norm, lr_scheduler, scaler, inner
        self._micro = 0

    def backward(self, loss):
        if self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def _clip(self):
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.strategy == "fsdp":
            from torch.distributed.tensor import DTensor

            total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
            if isinstance(total, DTensor):
                total = total.full_tensor()
            torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, total)
            return total
        return torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)

    def step(self):
        if self.optimizer is None:
            raise ParallelError("prepare() was called without an optimizer; pass optimizer= to train")
        self._micro += 1
        if self._micro % self.gradient_accumulation_steps:
            return False
        if self.scaler is not None:
            if self.max_grad_norm:
                self.scaler.unscale_(self.optimizer)
                self._clip()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            if self.max_grad_norm:
                self._clip()
            self.optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return True

    def zero_grad(self):
        if self.optimizer is not None and self._micro % self.gradient_accumulation_steps == 0:
            self.optimizer.zero_grad(set_to_none=True)

    @contextlib.contextmanager
    def accumulate(self):
        sync = self.sync_gradients
        if sync or self.strategy == "none":
            yield
        elif self.strategy == "ddp":
            with self.model.no_sync():
                yield
        else:  # fsdp: keep unsharded grads locally, reduce-scatter on the last micro-batch
            self.model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.model.set_requires_gradient_sync(True)

    def unwrap(self):
        return self._inner


class DeepSpeedPrepared(Prepared):
    """``zero1``/``zero2``/``zero3``: DeepSpeed's engine owns backward, step and accumulation."""

    def __init__(self, strategy, engine, device, mixed_precision, gas, config):
        self.strategy, self.engine, self.model, self.device = strategy, engine, engine, device
        self.optimizer, self.lr_scheduler = engine.optimizer, engine.lr_scheduler
        self.mixed_precision, self.gradient_accumulation_steps, self.config = mixed_precision, gas, config

    @property
    def _micro(self):
        return self.engine.micro_steps

    def backward(self, loss):
        self.engine.backward(loss)  # scales by 1/gradient_accumulation_steps itself

    def step(self):
        boundary = self.engine.is_gradient_accumulation_boundary()
        self.engine.step()
        return boundary

    def zero_grad(self):
        pass  # the engine zeroes gradients after each optimizer step

    @contextlib.contextmanager
    def accumulate(self):
        yield  # the engine reduces gradients only on the boundary by itself

    def unwrap(self):
        return self.engine.module


def prepare(model: nn.Module, optimizer: OptimizerArg = None, strategy: str = "auto", *,
            mixed_precision: Optional[str] = None, activation_checkpointing: bool = False,
            cpu_offload: bool = False, gradient_accumulation_steps: int = 1,
            max_grad_norm: Optional[float] = None, lr_scheduler: Optional[Callable] = None,
            blocks: BlockSpec = None, device: Optional[torch.device] = None,
            deepspeed_config: Optional[dict] = None, micro_batch_size: int = 1,
            ddp_kwargs: Optional[dict] = None, fsdp_kwargs: Optional[dict] = None,
            planner_kwargs: Optional[dict] = None) -> Prepared:
    """Wrap ``model`` (and build ``optimizer`` on the right parameters) for ``strategy``.

    Args:
        model: a plain ``nn.Module`` (on CPU or meta-free device memory).
        optimizer: a factory ``fn(params) -> Optimizer`` (preferred), an optimizer class, or a built
            optimizer. Under FSDP2 a built optimizer is rebuilt on the sharded parameters (with a warning).
        strategy: ``"none"``, ``"ddp"``, ``"fsdp"``, ``"zero1"``, ``"zero2"``, ``"zero3"`` or ``"auto"``.
        mixed_precision: ``"bf16"``, ``"fp16"`` or ``None`` (fp32). DDP/none use autocast (+ GradScaler
            for fp16); FSDP2 a ``MixedPrecisionPolicy`` (fp32 gradient reduction); ZeRO DeepSpeed's own.
        activation_checkpointing: recompute each block's activations in backward.
        cpu_offload: FSDP2 ``CPUOffloadPolicy``; ZeRO optimizer (and ZeRO-3 parameter) offload.
        gradient_accumulation_steps: micro-batches per optimizer step; ``backward`` divides the loss.
        max_grad_norm: clip the global gradient norm before each step.
        lr_scheduler: a factory ``fn(optimizer) -> scheduler`` stepped once per optimizer step.
        blocks: FSDP2 wrap / checkpoint units; default: detected (see :func:`find_blocks`).
        deepspeed_config: dict deep-merged over the generated DeepSpeed config.
    """
    strategy = normalize_strategy(strategy)
    if not isinstance(model, nn.Module):
        raise ParallelError(f"prepare() takes an nn.Module, got {type(model).__name__}")
    _check_optimizer_arg(optimizer)
    if mixed_precision not in _MIXED:
        raise ParallelError(f"mixed_precision must be 'bf16', 'fp16' or None, got {mixed_precision!r}")
    if mixed_precision in ("no", "fp32"):
        mixed_precision = None
    if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
        raise ParallelError(f"gradient_accumulation_steps must be an int >= 1, got {gradient_accumulation_steps!r}")
    if lr_scheduler is not None and not callable(lr_scheduler):
        raise ParallelError("lr_scheduler must be a factory `fn(optimizer) -> scheduler`")
    if lr_scheduler is not None and isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise ParallelError("pass lr_scheduler as a factory `lambda opt: Scheduler(opt, ...)`, not a built "
                            "scheduler: the optimizer it must drive is built inside prepare()")
    device = torch.device(device) if device is not None else _env.default_device()

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
    if strategy != "none":
        _env.require_process_group(strategy)
    if cpu_offload and strategy in ("none", "ddp"):
        raise ParallelError(f"cpu_offload=True needs strategy 'fsdp' or 'zero1/2/3', not {strategy!r}")
    if cpu_offload and device.type == "cpu":
        warnings.warn("cpu_offload=True has no effect when training on the CPU; ignoring it", stacklevel=2)
        cpu_offload = False
    if isinstance(optimizer, torch.optim.Optimizer):
        _check_optimizer_owns(optimizer, model)
    # tracking hook: the chosen strategy becomes a parameter of the launch's MLflow run
    from ..tracking.inrank import record_param
    record_param("strategy", strategy)
    record_param("mixed_precision", mixed_precision or "fp32")

    if strategy.startswith("zero"):
        return _prepare_deepspeed(model, optimizer, strategy, device, mixed_precision, activation_checkpointing,
                                  cpu_offload, gradient_accumulation_steps, max_grad_norm, lr_scheduler,
                                  blocks, deepspeed_config, micro_batch_size)
    if deepspeed_config:
        raise ParallelError(f"deepspeed_config= applies to zero1/zero2/zero3, not strategy={strategy!r}")
    dtype = _MIXED[mixed_precision]

    blist = find_blocks(model, blocks) if (strategy == "fsdp" or activation_checkpointing) else []
    if activation_checkpointing:
        if not blist:
            raise ParallelError("activation_checkpointing=True but no repeated blocks were found; pass blocks=")
        _apply_activation_checkpointing(blist)

    if strategy == "fsdp":
        wrapped, opt = _apply_fsdp(model, optimizer, device, dtype, cpu_offload, blist, fsdp_kwargs or {})
        inner = wrapped
    else:
        model.to(device)
        opt = _build_optimizer(optimizer, model.parameters())
        inner = model
        if strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            kw = dict(ddp_kwargs or {})
            if device.type == "cuda":
                kw.setdefault("device_ids", [device.index])
            # gradients live in DDP's communication buckets instead of a second copy: saves 4 B/param
            kw.setdefault("gradient_as_bucket_view", True)
            wrapped = DDP(model, **kw)
        else:
            wrapped = model
        if dtype is not None:
            wrapped.forward = _autocast_forward(wrapped.forward, device.type, dtype)

    scaler = None
    if dtype is torch.float16 and opt is not None:
        scaler = torch.amp.GradScaler(device.type)
    sched = lr_scheduler(opt) if (lr_scheduler is not None and opt is not None) else None
    return TorchPrepared(strategy, wrapped, opt, device, mixed_precision, gradient_accumulation_steps,
                         max_grad_norm, sched, scaler, inner)


def _apply_fsdp(model, optimizer, device, dtype, cpu_offload, blist, fsdp_kwargs):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    # Record which param (by name) sat in which group before sharding replaces the Parameter objects.
    rebuild_groups = None
    if isinstance(optimizer, torch.optim.Optimizer):
        names = _param_names(model)
        rebuild_groups = [({k: v for k, v in g.items() if k != "params"}, [names[id(p)] for p in g["params"]])
                          for g in optimizer.param_groups]
        if len(optimizer.state):
            raise ParallelError("the optimizer passed to prepare(strategy='fsdp') already has state (it "
                                "stepped); FSDP2 replaces the parameters, so that state would be lost. "
                                "Pass a factory `lambda params: Opt(params, ...)` instead.")

    if not cpu_offload:
        model.to(device)
    mesh = fsdp_kwargs.pop("mesh", None) or init_device_mesh(device.type, (_env.world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
    kw = dict(mesh=mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy())
    kw.update(fsdp_kwargs)
    for i, block in enumerate(blist):
        # the last block is needed again right away in backward: keep it unsharded after forward
        fully_shard(block, **{"reshard_after_forward": i < len(blist) - 1, **kw})
    fully_shard(model, **kw)

    if rebuild_groups is not None:
        warnings.warn(
            f"prepare(strategy='fsdp') got an already-built {type(optimizer).__name__}; FSDP2 replaced the "
            "model's parameters with sharded ones, so it was rebuilt on them with the same param groups "
            "(an optimizer on the old parameters would never train). Pass a factory instead: "
            "`optimizer=lambda params: torch.optim.AdamW(params, ...)`.", stacklevel=3)
        params = dict(model.named_parameters())
        groups = [{**hp, "params": [params[n] for n in ns]} for hp, ns in rebuild_groups]
        accepted = inspect.signature(type(optimizer).__init__).parameters
        opt = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
    else:
        opt = _build_optimizer(optimizer, model.parameters())
    return model, opt


def _prepare_deepspeed(model, optimizer, strategy, device, mixed_precision, activation_checkpointing,
                       cpu_offload, gas, max_grad_norm, lr_scheduler, blocks, overrides, micro_batch_size):
    try:
        import deepspeed
    except ImportError as e:
        raise ParallelError(f"strategy={strategy!r} needs DeepSpeed: pip install 'gpulaunch[deepspeed]' "
                            f"(or pip install deepspeed); import failed: {e}") from e
    stage = int(strategy[-1])
    if activation_checkpointing:
        blist = find_blocks(model, blocks)
        if not blist:
            raise ParallelError("activation_checkpointing=True but no repeated blocks were found; pass blocks=")
        _apply_activation_checkpointing(blist)
    cfg = deepspeed_config(stage, mixed_precision=mixed_precision, gradient_accumulation_steps=gas,
                           max_grad_norm=max_grad_norm, cpu_offload=cpu_offload,
                           micro_batch_size=micro_batch_size, overrides=overrides)
    kwargs: dict[str, Any] = dict(model=model, config=cfg, dist_init_required=False)
    if optimizer is not None:
        kwargs["optimizer"] = optimizer
        if not isinstance(optimizer, torch.optim.Optimizer):
            kwargs["model_parameters"] = [p for p in model.parameters() if p.requires_grad]
    if lr_scheduler is not None:
        kwargs["lr_scheduler"] = lr_scheduler
    if device.type == "cuda":
        torch.cuda.set_device(device)
    engine, _opt, _, _sched = deepspeed.initialize(**kwargs)
    return DeepSpeedPrepared(strategy, engine, engine.device, mixed_precision, gas, cfg)
