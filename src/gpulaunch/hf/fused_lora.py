"""A fused, compile-friendly forward for peft's LoRA linear layers.

peft's ``lora.Linear.forward`` computes ``base(x) + lora_B(lora_A(dropout(x))) * scaling`` through
three module calls, a loop over adapters and, when the adapters are fp32 beside a bf16 base (peft's
default, ``autocast_adapter_dtype=True``), an fp32 copy of every activation and fp32 rank-r
matmuls. ``fuse_lora(model)`` swaps the class of each LoRA linear that has one plain adapter
(no DoRA or other variant, no LoRA bias) for a subclass whose forward
does the same maths in the activations' dtype, in one of two forms:

- ``"merged"`` (default): ``y = x @ (W + s B A)^T + b`` -- one big matmul a layer instead of
  one big and two skinny ones, with a hand-written backward that never forms the weight
  gradient of the frozen ``W``: ``dx = g (W + s B A)``, ``dB = s g^T (x A^T)``,
  ``dA = s (g B)^T x``. The merged weight is rebuilt in the backward (a rank-r product,
  cheap) rather than kept, so memory stays as peft's.
- ``"split"``: ``y = x @ W^T + b + s (x @ A^T) @ B^T`` as plain tensor ops, for the compiler to
  fuse. LoRA dropout (``lora_dropout > 0`` while training) always takes this form: the dropped
  input only reaches the adapter, so it cannot be merged into ``W``.

Nothing else changes: the parameters (``lora_A.<name>.weight``, ``lora_B.<name>.weight``) are
the same objects, so ``state_dict``, ``save_pretrained`` and the optimizer see exactly what peft
gives them, and adapters trained fused load back in plain peft. A module falls back to peft's own
forward, call by call, whenever the fused maths would not be the same: adapters disabled or
merged, another adapter active, extra forward arguments, or weights still sharded (an FSDP2 unit
around the adapter itself).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from peft.tuners.lora import Linear as PeftLoraLinear
from peft.tuners.lora import LoraLayer
from torch import nn

__all__ = ["fuse_lora", "unfuse_lora", "FusedLoraLinear", "lora_linear_merged", "MODES"]

MODES = ("merged", "split")


class _MergedLoraLinear(torch.autograd.Function):
    """y = x (W + s B A)^T + b, with the LoRA gradients computed from x and g directly."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scale):
        merged = torch.addmm(weight, lora_b, lora_a, alpha=scale)
        ctx.save_for_backward(x, weight, lora_a, lora_b)
        ctx.scale, ctx.has_bias = scale, bias is not None
        return F.linear(x, merged, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight, lora_a, lora_b = ctx.saved_tensors
        s = ctx.scale
        g2 = grad.reshape(-1, grad.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        gx = gw = gb = ga = gB = None
        if ctx.needs_input_grad[0]:
            gx = (grad @ torch.addmm(weight, lora_b, lora_a, alpha=s))
        if ctx.needs_input_grad[1]:          # only when the base weight is trained too
            gw = g2.t() @ x2
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        if ctx.needs_input_grad[3]:
            ga = (g2 @ lora_b).t() @ x2 * s            # (r, in)
        if ctx.needs_input_grad[4]:
            gB = g2.t() @ (x2 @ lora_a.t()) * s        # (out, r)
        return gx, gw, gb, ga, gB, None


def lora_linear_merged(x, weight, bias, lora_a, lora_b, scale: float):
    """``x @ (weight + scale * lora_b @ lora_a)^T + bias`` with LoRA-shaped gradients; every
    tensor in ``x``'s dtype."""
    return _MergedLoraLinear.apply(x, weight, bias, lora_a, lora_b, float(scale))


def _is_sharded(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:      # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)


def _compute_dtype(x):
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class _FusedForward:
    """The forward of a fused LoRA linear (mixed into a subclass of peft's ``lora.Linear``)."""

    _gpulaunch_fused_adapter: str = "default"
    _gpulaunch_fuse_mode: str = "merged"

    def forward(self, x, *args, **kwargs):
        name = self._gpulaunch_fused_adapter
        dropout = self.lora_dropout[name]
        base = self.base_layer
        lora_a = self.lora_A[name].weight
        lora_b = self.lora_B[name].weight
        if (args or kwargs or self.disable_adapters or self.merged
                or self.active_adapters != [name]
                or _is_sharded(lora_a) or _is_sharded(lora_b) or _is_sharded(base.weight)):
            return super().forward(x, *args, **kwargs)
        dtype = _compute_dtype(x)
        # dropout on the adapter's input cannot be merged into W: the split form then, with
        # peft's own dropout module (the same random mask peft would draw)
        dropping = self.training and isinstance(dropout, nn.Dropout) and dropout.p > 0
        with torch.autocast(x.device.type, enabled=False):
            x = x.to(dtype)
            weight = base.weight.to(dtype)
            bias = None if base.bias is None else base.bias.to(dtype)
            a, b = lora_a.to(dtype), lora_b.to(dtype)
            scale = self.scaling[name]
            if self._gpulaunch_fuse_mode == "merged" and not dropping:
                return lora_linear_merged(x, weight, bias, a, b, scale)
            xa = dropout(x) if dropping else x
            return F.linear(x, weight, bias) + F.linear(F.linear(xa, a), b) * scale


class FusedLoraLinear(_FusedForward, PeftLoraLinear):
    """peft's ``lora.Linear`` with the fused forward (what ``fuse_lora`` turns one into)."""


def _why_not(module) -> str | None:
    """None when ``module`` can take the fused forward; otherwise the reason it cannot."""
    if type(module) is not PeftLoraLinear:
        return f"{type(module).__name__} (only peft's lora.Linear is fused)"
    names = list(module.lora_A.keys())
    if len(names) != 1:
        return f"{len(names)} adapters"
    name = names[0]
    if getattr(module, "fan_in_fan_out", False):
        return "fan_in_fan_out (Conv1D base)"
    if name in getattr(module, "lora_variant", {}):
        return f"LoRA variant {type(module.lora_variant[name]).__name__} (DoRA, ...)"
    if module.lora_B[name].bias is not None:
        return "LoRA bias"
    if not isinstance(module.base_layer, nn.Linear):
        return f"base layer {type(module.base_layer).__name__}"
    return None


def fuse_lora(model, mode: str = "merged") -> dict:
    """Give every fusable peft LoRA linear in ``model`` the fused forward (see the module doc).

    Returns ``{"fused": n, "skipped": {qualified_name: reason}, "mode": mode}``. Raises
    ValueError for an unknown ``mode`` or a model without any LoRA linear layer. Call it before
    ``torch.compile`` and before a trainer wraps the model (``SFTTrainer(...)`` then
    ``fuse_lora(trainer.model)`` is fine: DDP/FSDP wrap it when training starts)."""
    if mode not in MODES:
        raise ValueError(f"fuse_lora(mode={mode!r}): use one of {', '.join(MODES)}")
    fused, skipped = 0, {}
    for qname, module in model.named_modules():
        if isinstance(module, FusedLoraLinear):
            module._gpulaunch_fuse_mode = mode
            fused += 1
        elif isinstance(module, LoraLayer):
            reason = _why_not(module)
            if reason:
                skipped[qname] = reason
                continue
            module.__class__ = FusedLoraLinear
            module._gpulaunch_fused_adapter = next(iter(module.lora_A.keys()))
            module._gpulaunch_fuse_mode = mode
            fused += 1
    if not fused and not skipped:
        raise ValueError("fuse_lora: the model has no peft LoRA linear layer; wrap it with "
                         "peft.get_peft_model(model, LoraConfig(...)) first")
    return {"fused": fused, "skipped": skipped, "mode": mode}


def unfuse_lora(model) -> int:
    """Give every fused LoRA linear back peft's own forward; returns how many were changed."""
    n = 0
    for module in model.modules():
        if isinstance(module, FusedLoraLinear):
            module.__class__ = PeftLoraLinear
            for attr in ("_gpulaunch_fused_adapter", "_gpulaunch_fuse_mode"):
                module.__dict__.pop(attr, None)
            n += 1
    return n
