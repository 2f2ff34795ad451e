"""``prepare()``: one call that makes a model + optimizer ready for DDP, FSDP2 (HSDP, x TP, x CP)
or DeepSpeed ZeRO.

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

Each strategy is a small object (:class:`Single`, :class:`Replicated`, :class:`Sharded`,
:class:`ZeRO`); the torch ones share one pipeline in the field's order: FP8 conversion, tensor
parallelism, activation checkpointing, compilation, then the data-parallel wrapper.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch
from torch import nn

from . import _env, auto
from ._env import ParallelError, log
from ._optim import OptimizerArg, build_optimizer, check_optimizer_arg, check_optimizer_owns
from .activation_checkpoint import apply_activation_checkpointing
from .auto import estimate_training_bytes
from .blocks import BlockSpec, find_blocks
from .compile import CompileArg, compile_in_place
from .ddp import apply_ddp, autocast_forward
from .fsdp import apply_fsdp
from .mesh import Mesh
from .prepared import DeepSpeedPrepared, Prepared, TorchPrepared  # noqa: F401 - re-exported
from .settings import PRECISIONS, STRATEGIES, PrepareSettings, normalize_strategy
from .zero import deepspeed_config, prepare_deepspeed

__all__ = ["PRECISIONS", "STRATEGIES", "Mesh", "PrepareSettings", "Prepared", "Replicated", "Sharded",
           "Single", "Strategy", "ZeRO", "deepspeed_config", "estimate_training_bytes", "normalize_strategy",
           "prepare"]


def _device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    import psutil

    local = int(os.environ.get("LOCAL_WORLD_SIZE", _env.world_size()))
    return psutil.virtual_memory().total // max(1, local)


def _choose_auto(model: nn.Module, device: torch.device, mixed_precision, **planner_kwargs) -> tuple[str, str]:
    return auto.choose(model, device, mixed_precision, _device_memory(device), **planner_kwargs)


def _tensor_only(built) -> bool:
    """A mesh of tensor (or context) ranks only: nothing for FSDP2 to shard over."""
    return built is not None and built.fsdp.size() == 1 and _env.world_size() > 1


# ----------------------------------------------------------------------------- strategy objects
class Strategy:
    """How one strategy turns a model into a :class:`Prepared`. ``mesh()`` says which layouts it
    accepts (a clear error for the rest); ``prepare()`` builds everything."""

    name = ""

    def mesh(self, s: PrepareSettings) -> Mesh | None:
        """The layout for this strategy: the user's (checked) or its default."""
        if s.mesh is not None and s.mesh.resolve(_env.world_size()).size > 1:
            raise ParallelError(f"strategy={self.name!r} takes no mesh= (got {s.mesh}): use strategy='fsdp' "
                                "for sharded, tensor- or context-parallel layouts, 'ddp' for replicate-only ones")
        return None

    def prepare(self, model: nn.Module, optimizer: OptimizerArg, s: PrepareSettings) -> Prepared:
        raise NotImplementedError


class TorchStrategy(Strategy):
    """The pipeline every torch-native strategy shares (torchtitan's order): FP8 conversion, tensor
    parallelism, activation checkpointing, then :meth:`wrap` (compilation and the wrapper)."""

    def prepare(self, model, optimizer, s):
        spec = self.mesh(s)
        built = spec.build(s.device.type) if spec is not None else None
        after_step = []
        if s.precision == "fp8":
            from .fp8 import convert_to_fp8
            converted, after_step = convert_to_fp8(model, fsdp=self.name == "fsdp" and not _tensor_only(built),
                                                   blocks=s.blocks, recipe=s.fp8_recipe)
            log.info("precision='fp8' (%s): %d linear layers in FP8: %s", s.fp8_recipe, len(converted),
                     ", ".join(converted))
        if built is not None and spec.tensor > 1:
            from .tensor_parallel import apply_tensor_parallel
            if not s.cpu_offload:
                model.to(s.device)
            apply_tensor_parallel(model, built.tensor, s.tensor_plan)
        if built is not None and spec.context > 1:
            from .context_parallel import prepare_model
            prepare_model(model)
        blist = find_blocks(model, s.blocks) if (self.name == "fsdp" or s.activation_checkpointing) else []
        if s.activation_checkpointing:
            apply_activation_checkpointing(blist, s.activation_checkpointing)
        wrapped, opt, inner = self.wrap(model, optimizer, s, blist, built)
        scaler = None
        if s.dtype is torch.float16 and opt is not None:
            scaler = torch.amp.GradScaler(s.device.type)
        sched = s.lr_scheduler(opt) if (s.lr_scheduler is not None and opt is not None) else None
        return TorchPrepared(self.name, wrapped, opt, s.device, s.mixed_precision, s.gradient_accumulation_steps,
                             s.max_grad_norm, sched, scaler, inner, after_step=after_step, mesh=built)

    def wrap(self, model, optimizer, s, blist, built):
        raise NotImplementedError


class Single(TorchStrategy):
    """``"none"``: plain training, autocast and compile only (each rank on its own)."""

    name = "none"

    def wrap(self, model, optimizer, s, blist, built):
        model.to(s.device)
        opt = build_optimizer(optimizer, model.parameters())
        if s.dtype is not None:
            model.forward = autocast_forward(model.forward, s.device.type, s.dtype)
        if s.compile is not None:
            compile_in_place(model, s.compile)
        return model, opt, model


class Replicated(TorchStrategy):
    """``"ddp"``: a full replica per rank, gradients all-reduced (:mod:`gpulaunch.parallel.ddp`)."""

    name = "ddp"

    def mesh(self, s):
        m = s.mesh
        if m is None:
            return None
        world = _env.world_size()
        if m.shard == -1:
            m = Mesh(replicate=m.replicate, shard=1, context=m.context, tensor=m.tensor)
        if m.shard > 1 or m.context > 1 or m.tensor > 1:
            raise ParallelError(f"strategy='ddp' only replicates; {m} shards or splits. Use strategy='fsdp' with "
                                f"it (HSDP is Mesh(replicate=R, shard=S)), or Mesh(replicate={world}) for DDP.")
        return m.resolve(world)

    def wrap(self, model, optimizer, s, blist, built):
        model.to(s.device)
        opt = build_optimizer(optimizer, model.parameters())
        wrapped = apply_ddp(model, s.device, s.dtype, s.compile, _env.world_size() == 1, s.ddp_kwargs)
        return wrapped, opt, model


class Sharded(TorchStrategy):
    """``"fsdp"``: FSDP2 over the mesh's shard (x context) ranks; HSDP when it also replicates;
    with tensor parallelism applied first when ``tensor > 1``."""

    name = "fsdp"

    def mesh(self, s):
        if s.mesh is None:
            return None if "mesh" in s.fsdp_kwargs else Mesh()
        m = s.mesh.resolve(_env.world_size())
        if m.context > 1:
            from .context_parallel import check_context_parallel
            check_context_parallel(s.device, m.context)
        return m

    def wrap(self, model, optimizer, s, blist, built):
        if _tensor_only(built):   # no data-parallel ranks to shard over
            if not s.cpu_offload:
                model.to(s.device)
            opt = build_optimizer(optimizer, model.parameters())
            if s.dtype is not None:
                model.forward = autocast_forward(model.forward, s.device.type, s.dtype)
            if s.compile is not None:
                for block in blist:
                    compile_in_place(block, s.compile)
            return model, opt, model
        wrapped, opt = apply_fsdp(model, optimizer, s.device, s.dtype, s.cpu_offload, blist, s.fsdp_kwargs,
                                  mesh=built.fsdp if built is not None else None, compile_opts=s.compile)
        return wrapped, opt, wrapped


class ZeRO(Strategy):
    """``"zero1"``/``"zero2"``/``"zero3"``: DeepSpeed's engine (:mod:`gpulaunch.parallel.zero`)."""

    def __init__(self, name: str):
        self.name = name

    def mesh(self, s):
        m = s.mesh
        if m is not None:
            r = m.resolve(_env.world_size())
            if r.replicate > 1 or r.context > 1 or r.tensor > 1:
                raise ParallelError(f"strategy={self.name!r} (DeepSpeed ZeRO) shards over every rank, 1-D; {r} "
                                    "needs strategy='fsdp' (FSDP2 shards like ZeRO-3 and takes any mesh)")
        return None

    def prepare(self, model, optimizer, s):
        self.mesh(s)
        return prepare_deepspeed(model, optimizer, self.name, s.device, s.mixed_precision,
                                 s.activation_checkpointing, s.cpu_offload, s.gradient_accumulation_steps,
                                 s.max_grad_norm, s.lr_scheduler, s.blocks, s.deepspeed_config,
                                 s.micro_batch_size, s.compile)


def strategy_object(name: str) -> Strategy:
    if name.startswith("zero"):
        return ZeRO(name)
    return {"none": Single, "ddp": Replicated, "fsdp": Sharded}[name]()


# ----------------------------------------------------------------------------- prepare()
def prepare(model: nn.Module, optimizer: OptimizerArg = None, strategy: str = "auto", *,
            mixed_precision: str | None = None, precision: str | None = None, fp8_recipe: str = "tensorwise",
            compile: CompileArg = False, activation_checkpointing: bool | str = False,
            cpu_offload: bool = False, gradient_accumulation_steps: int = 1,
            max_grad_norm: float | None = None, lr_scheduler: Callable | None = None,
            blocks: BlockSpec = None, device: torch.device | None = None,
            deepspeed_config: dict | None = None, micro_batch_size: int = 1,
            ddp_kwargs: dict | None = None, fsdp_kwargs: dict | None = None,
            planner_kwargs: dict | None = None, mesh: Mesh | dict | None = None,
            tensor_plan=None, fault_tolerant: bool = False) -> Prepared:
    """Wrap ``model`` (and build ``optimizer`` on the right parameters) for ``strategy``.

    Args:
        model: a plain ``nn.Module`` (on CPU or meta-free device memory).
        optimizer: a factory ``fn(params) -> Optimizer`` (preferred), an optimizer class, or a built
            optimizer. Under FSDP2 a built optimizer is rebuilt on the sharded parameters (with a warning).
        strategy: ``"none"``, ``"ddp"``, ``"fsdp"``, ``"zero1"``, ``"zero2"``, ``"zero3"`` or ``"auto"``
            (the planner's choice; ``"none"`` at world size 1; with ``mesh=``, the mesh's strategy).
        mesh: a :class:`Mesh` (or dict of its sizes): ``replicate`` x ``shard`` x ``context`` x
            ``tensor`` ranks. With ``"fsdp"``: HSDP (replicate > 1), tensor parallelism (tensor > 1,
            :mod:`~gpulaunch.parallel.tensor_parallel`), context parallelism (context > 1, CUDA only,
            :meth:`Prepared.context_parallel`). With ``"ddp"``: replicate only.
        tensor_plan: with ``Mesh(tensor>1)``: ``{module name pattern: ParallelStyle}`` or
            ``fn(model, tensor_mesh)``; default: the built-in plan for the reference model or an HF Llama.
        mixed_precision: ``"bf16"``, ``"fp16"`` or ``None`` (fp32). DDP/none use autocast (+ GradScaler
            for fp16); FSDP2 a ``MixedPrecisionPolicy`` (fp32 gradient reduction); ZeRO DeepSpeed's own.
        precision: ``"fp8"``: the blocks' linear layers in FP8 through torchao (GPUs of compute
            capability >= 8.9; the rest in bf16; not with ZeRO). See :mod:`gpulaunch.parallel.fp8`.
        fp8_recipe: ``"tensorwise"`` (default) or ``"rowwise"`` scaling for ``precision="fp8"``.
        compile: ``True`` or a dict of ``torch.compile`` options: compile where each strategy gains
            most (per block before sharding for FSDP2; see :mod:`gpulaunch.parallel.compile`).
        activation_checkpointing: ``True``/``"full"`` recomputes each block's activations in backward;
            ``"selective"`` recomputes only the cheap ops (:mod:`~gpulaunch.parallel.activation_checkpoint`).
        cpu_offload: FSDP2 ``CPUOffloadPolicy``; ZeRO optimizer (and ZeRO-3 parameter) offload.
        gradient_accumulation_steps: micro-batches per optimizer step; ``backward`` divides the loss.
        max_grad_norm: clip the global gradient norm before each step.
        lr_scheduler: a factory ``fn(optimizer) -> scheduler`` stepped once per optimizer step.
        blocks: FSDP2 wrap / checkpoint / compile units; default: detected (see :func:`find_blocks`).
        deepspeed_config: dict deep-merged over the generated DeepSpeed config.
        fault_tolerant: run this replica group under torchft (:func:`gpulaunch.ft.replicated`) inside a
            function started by :func:`gpulaunch.ft.run_replicas`: gradients averaged across the live
            groups, a restarted group healing from a live peer. Strategy 'auto', 'none' or 'ddp' (one
            rank per group), or 'fsdp' (HSDP: FSDP2 inside a group of ``ranks_per_group`` ranks, torchft
            across groups); see :mod:`gpulaunch.parallel.fault_tolerant`.
    """
    if not isinstance(model, nn.Module):
        raise ParallelError(f"prepare() takes an nn.Module, got {type(model).__name__}")
    check_optimizer_arg(optimizer)
    device = torch.device(device) if device is not None else _env.default_device()
    s = PrepareSettings.from_arguments(
        strategy=strategy, device=device, mixed_precision=mixed_precision, precision=precision,
        fp8_recipe=fp8_recipe, compile=compile, activation_checkpointing=activation_checkpointing,
        cpu_offload=cpu_offload, gradient_accumulation_steps=gradient_accumulation_steps,
        max_grad_norm=max_grad_norm, lr_scheduler=lr_scheduler, blocks=blocks, deepspeed_config=deepspeed_config,
        micro_batch_size=micro_batch_size, ddp_kwargs=ddp_kwargs, fsdp_kwargs=fsdp_kwargs,
        planner_kwargs=planner_kwargs, mesh=mesh, tensor_plan=tensor_plan)
    if s.precision == "fp8":
        from .fp8 import check_fp8_hardware
        check_fp8_hardware(device)   # before anything is imported, converted or wrapped

    name = s.strategy
    if fault_tolerant:
        from .fault_tolerant import check_fault_tolerant, prepare_fault_tolerant
        check_fault_tolerant(s, name)
        if isinstance(optimizer, torch.optim.Optimizer):
            check_optimizer_owns(optimizer, model)
        from ..tracking.inrank import record_param
        record_param("strategy", "ft")
        return prepare_fault_tolerant(model, optimizer, s)
    if name == "auto":
        if s.mesh is not None:
            name, reason = auto.strategy_for_mesh(s.mesh.resolve(_env.world_size()))
        else:
            name, reason = _choose_auto(model, device, s.mixed_precision, **s.planner_kwargs)
        log.info("strategy='auto' chose %r: %s", name, reason)
        if _env.rank() == 0:
            print(f"[gpulaunch.parallel] strategy='auto' -> {name!r}: {reason}", flush=True)
        s = s.replace(strategy=name)
    if name.startswith("zero") and s.mixed_precision == "fp16" and device.type == "cpu":
        raise ParallelError(
            f"DeepSpeed does not support fp16 on CPU (its CPU accelerator refuses 'fp16'), so "
            f"strategy={name!r} with mixed_precision='fp16' cannot run here: use mixed_precision='bf16' "
            "or None on CPU, or run on a GPU.")
    if name.startswith("zero") and s.precision == "fp8":
        raise ParallelError(f"precision='fp8' works with strategy 'none', 'ddp' or 'fsdp', not {name!r}: "
                            "DeepSpeed's ZeRO does not handle torchao's float8 weights. Use strategy='fsdp' "
                            "(it shards like ZeRO-3) with precision='fp8'.")
    strat = strategy_object(name)
    strat.mesh(s)   # a layout this strategy cannot take fails before anything is built
    if name != "none":
        _env.require_process_group(name)
    if s.cpu_offload and name in ("none", "ddp"):
        raise ParallelError(f"cpu_offload=True needs strategy 'fsdp' or 'zero1/2/3', not {name!r}")
    if s.cpu_offload and device.type == "cpu":
        warnings.warn("cpu_offload=True has no effect when training on the CPU; ignoring it", stacklevel=2)
        s = s.replace(cpu_offload=False)
    if s.deepspeed_config and not name.startswith("zero"):
        raise ParallelError(f"deepspeed_config= applies to zero1/zero2/zero3, not strategy={name!r}")
    if isinstance(optimizer, torch.optim.Optimizer):
        check_optimizer_owns(optimizer, model)
    # tracking hook: the chosen strategy becomes a parameter of the launch's MLflow run
    from ..tracking.inrank import record_param
    record_param("strategy", name)
    record_param("mixed_precision", s.precision or s.mixed_precision or "fp32")
    if s.mesh is not None:
        record_param("mesh", str(s.mesh.resolve(_env.world_size())))
    return strat.prepare(model, optimizer, s)
