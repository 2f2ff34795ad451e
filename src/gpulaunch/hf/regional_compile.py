"""Compile the repeated decoder layers of an HF model, not the whole model (regional compilation,
as torchtitan compiles each transformer block).

    from gpulaunch.hf import compile_layers
    report = compile_layers(trainer.model)     # after fuse_lora, before trainer.train()
    # {'compiled': 16, 'layer': 'LlamaDecoderLayer'}

Why not ``TrainingArguments(torch_compile=True)``, which compiles the whole model:

- What is outside the layers is not the compiler's to fuse. TRL's ``SFTTrainer`` replaces the
  LM head and loss with its own chunked log-prob (Triton kernels inside an autograd Function);
  on a GPU it scores only the positions with a label (``hidden[mask]``), whose count changes
  with every batch. Traced whole, that is a data-dependent shape and graph breaks around the
  Triton calls, and each new count recompiles the frames after them; measured on an H100
  (torch 2.11, TRL 1.16, Llama-3.2-1B shape, 4 x 2048 tokens), no training step finished in
  240 s, the GPU idle and one CPU core compiling.
- Every decoder layer runs the same code, so one compiled graph serves all of them: the compile
  takes one layer's time, not the model's, and Dynamo's cache holds a handful of entries for
  that code (train and eval, static and dynamic sequence length) instead of one per frame.
- Only ``forward`` is compiled; the module's ``__call__`` (and so DDP's, FSDP2's and
  gradient checkpointing's hooks around the layer) stays eager, and the parameters, their names
  and the ``state_dict`` are unchanged (no ``_orig_mod.`` prefix), so peft's
  ``save_pretrained``, TRL's FSDP wrap-by-class-name and checkpoints see the model as before.

Which modules are "the layers": the classes the model names in ``_no_split_modules`` (what
``device_map`` and FSDP wrap by), found under peft's wrapper too; else the longest
``nn.ModuleList`` whose children are all of one class.
"""

from __future__ import annotations

from typing import Any

__all__ = ["compile_layers", "find_layers", "uncompile_layers"]

_ORIGINAL = "_gpulaunch_eager_forward"


def _hf_model(model):
    """Under peft's PeftModel/LoraModel wrappers, the transformers model that names its layers."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if getattr(model, "_no_split_modules", None):
            return model
        inner = getattr(model, "base_model", None)
        if inner is None or inner is model:
            inner = getattr(model, "model", None)
        if inner is None:
            return model
        model = inner
    return model


def find_layers(model) -> list:
    """The repeated blocks of ``model`` (see the module docstring), in model order."""
    from torch import nn
    names = set(getattr(_hf_model(model), "_no_split_modules", None) or ())
    if names:
        layers = [m for m in model.modules() if type(m).__name__ in names]
        if layers:
            return layers
    best: list = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > len(best) and len({type(c) for c in m}) == 1:
            best = list(m)
    return best


def compile_layers(model, **compile_kwargs: Any) -> dict:
    """Compile ``forward`` of every decoder layer of ``model`` with ``torch.compile``
    (``compile_kwargs`` go to it, e.g. ``mode="max-autotune-no-cudagraphs"``). Call it after
    anything that swaps modules inside the layers (``fuse_lora``, peft itself) and before the
    model is wrapped for training; compilation happens at the first forward. Calling it again
    on a compiled model changes nothing. Returns ``{"compiled": n, "layer": class name}``."""
    import torch
    layers = find_layers(model)
    if not layers:
        raise ValueError(
            f"compile_layers: found no repeated layers in {type(model).__name__} (no "
            "_no_split_modules and no nn.ModuleList of one class); compile the model itself "
            "with torch.compile(model) instead")
    compiled = 0
    for layer in layers:
        if _ORIGINAL in layer.__dict__:
            continue
        eager = layer.forward
        layer.__dict__[_ORIGINAL] = eager
        # an instance attribute wins over the class's forward in Module.__call__; the hooks
        # around it stay eager
        layer.forward = torch.compile(eager, **compile_kwargs)
        compiled += 1
    return {"compiled": compiled, "layer": type(layers[0]).__name__}


def uncompile_layers(model) -> int:
    """Undo ``compile_layers``: the layers' own forwards again. Returns how many."""
    n = 0
    for layer in find_layers(model):
        eager = layer.__dict__.pop(_ORIGINAL, None)
        if eager is not None:
            layer.__dict__.pop("forward", None)
            n += 1
    return n
