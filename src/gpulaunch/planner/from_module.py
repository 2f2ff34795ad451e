"""nn.Module -> ModelShape. torch is imported only here, only when a module is passed.

Parameters are counted exactly from the module (meta tensors included). The activation model needs
the architecture: a Hugging Face model carries its config (``module.config``); anything else is
planned as "generic" (parameters, gradients and optimizer state exact; activations not modelled).
"""
from __future__ import annotations

from dataclasses import replace

from . import hf_config
from .shapes import ModelShape


def from_module(module) -> ModelShape:
    import torch  # noqa: F401  (lazy: importing the planner must not import torch)

    seen: set[int] = set()
    total = trainable = 0
    largest = 0
    for p in module.parameters():
        if id(p) in seen:    # tied weights count once
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    for child in module.modules():
        n = sum(p.numel() for p in child.parameters(recurse=False))
        largest = max(largest, n)
    name = type(module).__name__
    cfg = getattr(module, "config", None)
    if cfg is not None and hasattr(cfg, "to_dict"):
        try:
            shape = hf_config.from_dict(cfg.to_dict(), name=name)
            # Exact counts win over derived ones; trainable < total means the module is already
            # partly frozen (e.g. a peft model), which plan() treats like LoRA without adding adapters.
            return replace(shape, params_override=total,
                           trainable_override=trainable if trainable != total else None)
        except ValueError:
            pass
    return ModelShape(name=name, family="generic", params_override=total,
                      trainable_override=trainable if trainable != total else None,
                      largest_layer_override=largest or total,
                      notes=("activations not modelled for a generic module: pass a HF config or ModelShape",))
