"""ZeRO-3 with each decoder layer as one unit, so that the layers compile under DeepSpeed.

    from gpulaunch.hf import compile_layers, zero3_layer_units
    zero3_layer_units(trainer.model)   # before trainer.train() (deepspeed.initialize)
    compile_layers(trainer.model)

Why: DeepSpeed's ZeRO-3 registers a gather hook before and a release hook after the forward of
*every* submodule (each attention projection, each MLP linear, each norm), and the same again
for backward. A compiled decoder layer then has those hooks inside it; they are
``torch.compiler.disable``d, so Dynamo breaks the graph at each one (41 breaks and 14 graphs for
a 4-layer Llama on CPU), and the parameters' state flips between the pieces, so the pieces
recompile until Dynamo's recompile limit (measured on an H200, torch 2.11: the compiled ZeRO-3
recipe ran slower than the uncompiled one; as units with torch's F.linear, on an H100: 1.95x
the uncompiled recipe). Uncompiled, the hooks are the step's CPU cost: with
one process the tuned ZeRO-3 recipe ran at 0.44x a compiled full fine-tuning loop.

DeepSpeed's "leaf modules" (``deepspeed.utils.set_z3_leaf_modules``) move those hooks to one
module: a leaf gathers all of its parameters (its submodules' included) in one all-gather
before its forward and backward and releases them after, and nothing inside it is hooked. Made
leaves, the decoder layers are ZeRO-3's unit the way a ``fully_shard``ed block is FSDP2's, so
each compiled layer forward is one graph (CPU, 2 gloo ranks: 0 breaks, 1 graph, the losses of
the uncompiled run). Memory: a layer's parameters are whole only while that layer computes,
as with FSDP2; the prefetch and reuse settings work on the layers instead of their linears.
"""

from __future__ import annotations

import warnings

from ..parallel.zero import plain_linear
from .regional_compile import find_layers

__all__ = ["zero3_layer_units"]


def zero3_layer_units(model) -> dict:
    """Make every decoder layer of ``model`` (what ``compile_layers`` compiles) a ZeRO-3 leaf
    module. Call it before DeepSpeed wraps the model (``deepspeed.initialize``, which the HF
    Trainer calls in ``train()``): DeepSpeed reads the flag when it registers its hooks.
    Also puts torch's ``F.linear`` back if DeepSpeed replaced it (``gpulaunch.parallel.zero.
    plain_linear``), and warns if the trainer's ZeRO-3 config would replace it again: set
    ``"memory_efficient_linear": false`` in its ``zero_optimization``.
    Returns ``{"units": n, "layer": class name, "restored_linear": bool}``."""
    try:
        # by class, DeepSpeed's documented call (deepspeed 0.16.0 has it with this signature)
        from deepspeed.utils import set_z3_leaf_modules
    except ImportError as e:
        raise ImportError("zero3_layer_units needs DeepSpeed: pip install deepspeed") from e
    layers = find_layers(model)
    if not layers:
        raise ValueError(
            f"zero3_layer_units: found no repeated layers in {type(model).__name__} (no "
            "_no_split_modules and no nn.ModuleList of one class)")
    hooked = [layer for layer in layers for m in layer.modules() if "pre_bwd_fn" in m.__dict__]
    if hooked:
        # DeepSpeed's engine already hooked the submodules: the flag would change nothing
        raise RuntimeError(
            "zero3_layer_units: DeepSpeed has already wrapped this model (its ZeRO-3 hooks are "
            "on the submodules); call it before deepspeed.initialize / trainer.train()")
    set_z3_leaf_modules(model, list(dict.fromkeys(type(layer) for layer in layers)))
    # torch's F.linear inside the compiled layers, not DeepSpeed's (plain_linear says why)
    restored = plain_linear()
    _warn_if_linear_replaced_later()
    return {"units": len(layers), "layer": type(layers[0]).__name__,
            "restored_linear": restored}


def _warn_if_linear_replaced_later() -> None:
    """The HF Trainer's ZeRO-3 config, if one is active: with ``memory_efficient_linear`` on
    (DeepSpeed's default) ``trainer.train()`` replaces F.linear again when it wraps the model."""
    try:
        from transformers.integrations.deepspeed import deepspeed_config
    except ImportError:
        return
    cfg = deepspeed_config()
    zero = (cfg or {}).get("zero_optimization") or {}
    if cfg is not None and zero.get("stage") == 3 and zero.get("memory_efficient_linear") is not False:
        warnings.warn(
            "zero3_layer_units: the trainer's DeepSpeed config leaves zero_optimization."
            "memory_efficient_linear on (DeepSpeed's default), so train() replaces torch's "
            "F.linear with DeepSpeed's, whose backward Dynamo guards per layer: compiled layers "
            "recompile for each layer and run eagerly past the recompile limit. Set "
            '"memory_efficient_linear": false in zero_optimization.', stacklevel=3)
