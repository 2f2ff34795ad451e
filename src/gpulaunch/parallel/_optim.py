"""The optimizer argument of ``prepare()``: a factory (preferred) or a built optimizer, checked."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ._env import ParallelError

OptimizerArg = torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None


def check_optimizer_arg(optimizer: OptimizerArg) -> None:
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer) or callable(optimizer):
        return
    raise ParallelError(
        f"optimizer must be a torch.optim.Optimizer or a factory `fn(params) -> Optimizer` "
        f"(e.g. `lambda ps: torch.optim.AdamW(ps, lr=1e-3)`), got {type(optimizer).__name__}")


def build_optimizer(optimizer: OptimizerArg, params) -> torch.optim.Optimizer | None:
    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    opt = optimizer(params)
    if not isinstance(opt, torch.optim.Optimizer):
        raise ParallelError(f"the optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer")
    return opt


def param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}


def check_optimizer_owns(opt: torch.optim.Optimizer, model: nn.Module) -> None:
    mine = {id(p) for p in model.parameters()}
    foreign = sum(1 for g in opt.param_groups for p in g["params"] if id(p) not in mine)
    if foreign:
        raise ParallelError(
            f"the optimizer holds {foreign} parameter(s) that are not this model's (built on another "
            "model or a copy?). Pass a factory `lambda params: Opt(params, ...)` so prepare() builds it.")
