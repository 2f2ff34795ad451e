"""FP8 training on GPUs with FP8 tensor cores, through torchao's float8 linear layers.

``prepare(..., precision="fp8")`` swaps the ``nn.Linear`` layers inside the model's repeated
blocks for torchao's ``Float8Linear`` (``fp8_recipe="tensorwise"``, the default: dynamic
per-tensor scaling, the recipe torchtitan measured fastest on H100; or ``"rowwise"``: one scale
per row, more accurate, its all-gathers in bf16), before activation checkpointing, compilation and sharding, in that
order. The rest of the model computes in bf16. Left in bf16, on purpose:

* everything outside the blocks: the first and the last layers (embedding, output head), whose
  precision matters most for the loss and which torchao and torchtitan leave out too;
* layers with a dimension not divisible by 16 (the FP8 matmul kernels require it);
* small matmuls: ``out_features <= 1024`` with ``in_features <= 4096``, where the casts to FP8
  cost more than the faster matmul saves (torchao's tensorwise break-even measured on H100).

Under FSDP2 the all-gathers carry FP8 weights (half of bf16's bytes), and after each optimizer
step one all-reduce precomputes the next step's weight scales.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ._env import ParallelError
from .blocks import find_blocks

__all__ = ["MIN_CAPABILITY", "RECIPES", "check_fp8_hardware", "check_recipe", "convert_to_fp8", "fp8_candidates"]

# Ada (8.9), Hopper (9.0) and later have FP8 tensor cores; Ampere (8.0/8.6) does not.
MIN_CAPABILITY = (8, 9)
_SMALL_OUT, _SMALL_IN = 1024, 4096
RECIPES = ("tensorwise", "rowwise")


def check_fp8_hardware(device: torch.device) -> None:
    """A clear error, before anything is imported or converted, where FP8 cannot run."""
    if device.type != "cuda":
        raise ParallelError(
            f"precision='fp8' needs an NVIDIA GPU with FP8 tensor cores (compute capability >= "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}: Ada L4/L40S, Hopper H100/H200, Blackwell); "
            f"this rank trains on {device}. Use mixed_precision='bf16' here instead.")
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ParallelError(
            f"precision='fp8' needs FP8 tensor cores (compute capability >= "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}); {name} on {device} has {cap[0]}.{cap[1]}. "
            "Use mixed_precision='bf16' on this GPU.")


def fp8_candidates(model: nn.Module, blocks=None) -> list[str]:
    """Names of the ``nn.Linear`` layers that FP8 conversion would swap (see the module docstring)."""
    found = find_blocks(model, blocks)
    inside = {id(m) for b in found for m in b.modules()}
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not found and len(linears) > 2:   # no repeated blocks: leave out the first and the last layer
        inside = {id(m) for _, m in linears[1:-1]}
    out = []
    for name, m in linears:
        if id(m) not in inside:
            continue
        if m.in_features % 16 or m.out_features % 16:
            continue
        if m.out_features <= _SMALL_OUT and m.in_features <= _SMALL_IN:
            continue
        out.append(name)
    return out


def check_recipe(recipe: str) -> str:
    if recipe not in RECIPES:
        raise ParallelError(f"fp8_recipe= takes one of {', '.join(RECIPES)}, got {recipe!r}")
    return recipe


def convert_to_fp8(model: nn.Module, *, fsdp: bool, blocks=None,
                   recipe: str = "tensorwise") -> tuple[list[str], list[Callable[[], None]]]:
    """Swap the qualifying linears for ``Float8Linear`` in place. Returns (converted names,
    functions to run after each optimizer step).

    ``recipe``: ``"tensorwise"`` (one scale per tensor; under FSDP2 the all-gathers carry FP8) or
    ``"rowwise"`` (one scale per row: closer to bf16's loss at large widths, all-gathers in bf16)."""
    check_recipe(recipe)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ParallelError(
            f"precision='fp8' needs torchao (import failed: {e}). Install the torchao release "
            f"built for your torch ({torch.__version__}; torchao 0.17 for torch 2.11), e.g. "
            "`pip install torchao==0.17.0`.") from e
    names = set(fp8_candidates(model, blocks))
    if not names:
        raise ParallelError(
            "precision='fp8' found no linear layer worth converting: FP8 needs nn.Linear layers "
            "inside the repeated blocks with both dimensions divisible by 16 and not small "
            f"(out_features > {_SMALL_OUT} or in_features > {_SMALL_IN}). Use mixed_precision='bf16'.")
    if recipe == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp)
    else:   # torchao's rowwise recipe; its FSDP2 all-gathers stay in bf16
        config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn in names, config=config)
    after_step: list[Callable[[], None]] = []
    if fsdp and recipe == "tensorwise":
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        after_step.append(lambda: precompute_float8_dynamic_scale_for_fsdp(model))
    return sorted(names), after_step
