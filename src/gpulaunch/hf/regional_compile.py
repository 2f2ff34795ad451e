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

Output capture (router logits, attentions) inside the compiled layers: transformers records
them with forward hooks on modules inside each layer (gpt-oss: the router and the attention),
installed the first time they are asked for; TRL asks for router logits whenever a MoE has a
``router_aux_loss_coef``. Each hook reads the active collector from a ``ContextVar``, whose
``get`` Dynamo before torch 2.14 cannot trace: graph breaks in every layer (19 logged for
gpt-oss-20b on the H100, torch 2.11; 10 graphs instead of 2 for a 2-layer gpt-oss on CPU,
torch 2.13), and the resumed frames recompiled. So each compiled forward is wrapped:
the wrapper reads the collector eagerly and hands the layer a collector of its own through
transformers' ``CompileableContextVar`` compile mode (``compiling``/``global_var``, which the
hooks read as a plain attribute), then adds what the layer recorded to the real one. Caveat:
for the duration of a layer's forward that collector is process-global, as transformers' own
compile mode is: another thread capturing outputs at the same moment would record into it.
Where transformers has no such collector, the hooks run as before (graph breaks on old torch)
and the report says so.
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


def _collector():
    """transformers' active output collector, where it is the ``CompileableContextVar`` this
    module knows how to drive (private API: transformers 5.x, ``utils/output_capturing.py``);
    else None."""
    try:
        from transformers.utils import output_capturing
    except ImportError:
        return None
    var = getattr(output_capturing, "_active_collector", None)
    if type(var).__name__ != "CompileableContextVar" or not all(
            hasattr(var, a) for a in ("get", "global_var", "compiling", "context_var")):
        return None
    return var


def _with_capture(compiled, var):
    """``compiled`` with transformers' output collector handed to it traceably (module
    docstring). The hooks inside the layer then see ``var.global_var``: None, or a dict whose
    list values are new empty lists on every call. Fresh lists keep the guards the same for
    every layer and step (the real lists grow, and a guard on their length would recompile per
    layer); ``hidden_states`` keeps the real list, as its hook reads the length (transformers
    hooks it on the layer itself, outside the compiled forward, so the graph never sees it)."""
    import torch

    def forward(*args, **kwargs):
        if torch.compiler.is_compiling():     # inlined into an outer torch.compile: its rules
            return compiled(*args, **kwargs)
        collected = var.get()                 # eager, so the ContextVar is no graph break
        mine = None if collected is None else {
            k: [] if isinstance(v, list) and k != "hidden_states" else v
            for k, v in collected.items()}
        saved = var.global_var, var.compiling
        var.global_var, var.compiling = mine, True
        try:
            out = compiled(*args, **kwargs)
        finally:
            var.global_var, var.compiling = saved
        if mine:
            for k, v in mine.items():
                if v is not collected[k] and isinstance(v, list):
                    collected[k].extend(v)
        return out
    return forward


def compile_layers(model, **compile_kwargs: Any) -> dict:
    """Compile ``forward`` of every decoder layer of ``model`` with ``torch.compile``
    (``compile_kwargs`` go to it, e.g. ``mode="max-autotune-no-cudagraphs"``). Call it after
    anything that swaps modules inside the layers (``fuse_lora``, peft itself) and before the
    model is wrapped for training; compilation happens at the first forward. Calling it again
    on a compiled model changes nothing. Returns ``{"compiled": n, "layer": class name,
    "output_capture": ...}``: "traced" where transformers' output hooks inside the layers are
    made traceable (module docstring), else why not (they then run as without this module)."""
    import torch
    layers = find_layers(model)
    if not layers:
        raise ValueError(
            f"compile_layers: found no repeated layers in {type(model).__name__} (no "
            "_no_split_modules and no nn.ModuleList of one class); compile the model itself "
            "with torch.compile(model) instead")
    var = _collector()
    compiled = 0
    for layer in layers:
        if _ORIGINAL in layer.__dict__:
            continue
        eager = layer.forward
        layer.__dict__[_ORIGINAL] = eager
        # an instance attribute wins over the class's forward in Module.__call__; the hooks
        # around it stay eager
        layer.forward = torch.compile(eager, **compile_kwargs)
        if var is not None:
            layer.forward = _with_capture(layer.forward, var)
        compiled += 1
    capture = "traced" if var is not None else (
        "as transformers runs it (no CompileableContextVar "
        "transformers.utils.output_capturing._active_collector in this version)")
    return {"compiled": compiled, "layer": type(layers[0]).__name__, "output_capture": capture}


def uncompile_layers(model) -> int:
    """Undo ``compile_layers``: the layers' own forwards again. Returns how many."""
    n = 0
    for layer in find_layers(model):
        eager = layer.__dict__.pop(_ORIGINAL, None)
        if eager is not None:
            layer.__dict__.pop("forward", None)
            n += 1
    return n
