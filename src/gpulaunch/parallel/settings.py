"""Every setting of ``prepare()`` in one frozen, checked dataclass, so that each strategy object
reads the same names and no strategy re-validates its arguments."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ._env import ParallelError
from .activation_checkpoint import ac_mode
from .blocks import BlockSpec
from .compile import compile_options
from .mesh import Mesh, as_mesh

__all__ = ["MIXED", "PRECISIONS", "STRATEGIES", "PrepareSettings", "normalize_strategy"]

STRATEGIES = ("none", "ddp", "fsdp", "zero1", "zero2", "zero3", "auto")
_ALIASES = {
    "single": "none", "fsdp2": "fsdp", "fully_shard": "fsdp", "hsdp": "fsdp",
    "zero-1": "zero1", "zero-2": "zero2", "zero-3": "zero3",
    "deepspeed_zero1": "zero1", "deepspeed_zero2": "zero2", "deepspeed_zero3": "zero3",
}
MIXED = {None: None, "no": None, "fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISIONS = (None, "fp8")


def normalize_strategy(strategy: str) -> str:
    if not isinstance(strategy, str):
        raise ParallelError(f"strategy must be a string, one of {STRATEGIES}; got {strategy!r}")
    s = strategy.strip().lower()
    s = _ALIASES.get(s, s)
    if s not in STRATEGIES:
        raise ParallelError(f"unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    return s


@dataclasses.dataclass(frozen=True)
class PrepareSettings:
    """``prepare()``'s keyword arguments, normalised (see :func:`gpulaunch.parallel.prepare`)."""

    strategy: str
    device: torch.device
    mixed_precision: str | None = None        # None (fp32), "bf16" or "fp16"
    precision: str | None = None              # "fp8" or None
    fp8_recipe: str = "tensorwise"
    compile: dict[str, Any] | None = None     # torch.compile options, None: eager
    activation_checkpointing: str | None = None   # None, "full" or "selective"
    cpu_offload: bool = False
    gradient_accumulation_steps: int = 1
    max_grad_norm: float | None = None
    lr_scheduler: Callable | None = None
    blocks: BlockSpec = None
    deepspeed_config: dict | None = None
    micro_batch_size: int = 1
    ddp_kwargs: dict = dataclasses.field(default_factory=dict)
    fsdp_kwargs: dict = dataclasses.field(default_factory=dict)
    planner_kwargs: dict = dataclasses.field(default_factory=dict)
    mesh: Mesh | None = None
    tensor_plan: Any = None

    @property
    def dtype(self) -> torch.dtype | None:
        return MIXED[self.mixed_precision]

    def replace(self, **changes) -> PrepareSettings:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_arguments(cls, *, strategy, device, mixed_precision=None, precision=None, fp8_recipe="tensorwise",
                       compile=False, activation_checkpointing=False, cpu_offload=False,
                       gradient_accumulation_steps=1, max_grad_norm=None, lr_scheduler=None, blocks=None,
                       deepspeed_config=None, micro_batch_size=1, ddp_kwargs=None, fsdp_kwargs=None,
                       planner_kwargs=None, mesh=None, tensor_plan=None) -> PrepareSettings:
        """Check every argument, with an error that names the fix; nothing is imported or built yet."""
        strategy = normalize_strategy(strategy)
        if mixed_precision not in MIXED:
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
        from .fp8 import check_recipe
        check_recipe(fp8_recipe)
        if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
            raise ParallelError(f"gradient_accumulation_steps must be an int >= 1, got {gradient_accumulation_steps!r}")
        if lr_scheduler is not None and not callable(lr_scheduler):
            raise ParallelError("lr_scheduler must be a factory `fn(optimizer) -> scheduler`")
        if lr_scheduler is not None and isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
            raise ParallelError("pass lr_scheduler as a factory `lambda opt: Scheduler(opt, ...)`, not a built "
                                "scheduler: the optimizer it must drive is built inside prepare()")
        fsdp_kwargs = dict(fsdp_kwargs or {})
        mesh = as_mesh(mesh)
        if mesh is not None and "mesh" in fsdp_kwargs:
            raise ParallelError("pass the layout once: mesh=Mesh(...) or fsdp_kwargs={'mesh': DeviceMesh}, not both")
        if tensor_plan is not None and (mesh is None or mesh.tensor == 1):
            raise ParallelError("tensor_plan= applies with mesh=Mesh(tensor=N) for N > 1")
        return cls(strategy=strategy, device=device, mixed_precision=mixed_precision, precision=precision,
                   fp8_recipe=fp8_recipe, compile=compile_options(compile),
                   activation_checkpointing=ac_mode(activation_checkpointing), cpu_offload=bool(cpu_offload),
                   gradient_accumulation_steps=gradient_accumulation_steps, max_grad_norm=max_grad_norm,
                   lr_scheduler=lr_scheduler, blocks=blocks, deepspeed_config=deepspeed_config,
                   micro_batch_size=micro_batch_size, ddp_kwargs=dict(ddp_kwargs or {}), fsdp_kwargs=fsdp_kwargs,
                   planner_kwargs=dict(planner_kwargs or {}), mesh=mesh, tensor_plan=tensor_plan)
