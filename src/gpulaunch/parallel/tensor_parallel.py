"""Tensor parallelism: each linear layer of a block split across the ``tensor`` ranks of the mesh.

``prepare(..., mesh=Mesh(tensor=2, ...))`` applies a *tensor plan* (torch's ``parallelize_module``
plan: module name pattern -> ``ParallelStyle``) before activation checkpointing, compilation and
FSDP2, the order torchtitan uses. Built-in plans:

* gpulaunch's reference Llama (:mod:`gpulaunch.parallel.reference_model`): Megatron-style column /
  row splits of attention (q, k, v | o) and the MLP (w1, w3 | w2), with *sequence parallelism*
  between them (norms and residuals hold 1/tensor of the sequence each), as torchtitan's Llama.
  The output head is split by vocabulary and gathered back, so the loss is the plain one.
* Hugging Face Llama-style decoders (``q_proj``/``k_proj``/``v_proj``/``o_proj``,
  ``gate_proj``/``up_proj``/``down_proj``): the same column / row splits, without sequence
  parallelism (the embedding, norms and head stay replicated), which needs nothing of the model's
  own forward beyond reshaping heads with ``-1``, as transformers does.

Any other model: pass ``tensor_plan=`` a dict (``{"layers.*.attn.wq": ColwiseParallel(), ...}``)
or a function ``fn(model, tensor_mesh)`` that parallelizes the model itself.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ._env import ParallelError

__all__ = ["TensorPlan", "apply_tensor_parallel", "default_plan"]

TensorPlan = dict | Callable | None


def _reference_plan(model, tensor: int) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import SequenceParallel

    col, row, prep = _styles()
    c = model.config
    if c.n_heads % tensor or c.n_kv_heads % tensor:
        raise ParallelError(f"Mesh(tensor={tensor}) must divide the model's attention heads "
                            f"(n_heads={c.n_heads}, n_kv_heads={c.n_kv_heads}): each tensor rank holds whole heads")
    if c.ffn_dim % tensor or c.vocab_size % tensor:
        raise ParallelError(f"Mesh(tensor={tensor}) must divide ffn_dim ({c.ffn_dim}) and vocab_size ({c.vocab_size})")
    if c.chunked_loss:
        raise ParallelError("the reference model's chunked_loss reads the output head's weight whole, which tensor "
                            "parallelism splits: build the model with chunked_loss=0 when Mesh(tensor>1)")
    if c.tie_embeddings:
        raise ParallelError("tensor parallelism splits the embedding by rows and the head by columns, so they cannot "
                            "share one weight: build the model with tie_embeddings=False, or pass tensor_plan=")
    plan = {
        # the embedding splits the vocabulary and hands each rank 1/tensor of the sequence
        "tok_emb": row(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # the head gathers the sequence, splits the vocabulary, then gathers logits for the loss
        "lm_head": col(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(len(model.layers)):
        p = f"layers.{i}"
        plan.update({
            f"{p}.attn_norm": SequenceParallel(),
            f"{p}.attn": prep(input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)),
            f"{p}.attn.wq": col(), f"{p}.attn.wk": col(), f"{p}.attn.wv": col(),
            f"{p}.attn.wo": row(output_layouts=Shard(1)),
            f"{p}.mlp_norm": SequenceParallel(),
            f"{p}.mlp": prep(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            f"{p}.mlp.w1": col(), f"{p}.mlp.w3": col(),
            f"{p}.mlp.w2": row(output_layouts=Shard(1)),
        })
    return plan


def _hf_plan(model, tensor: int) -> dict:
    col, row, _ = _styles()
    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", heads)
    if heads and (heads % tensor or (kv or heads) % tensor):
        raise ParallelError(f"Mesh(tensor={tensor}) must divide the attention heads (num_attention_heads={heads}, "
                            f"num_key_value_heads={kv}): each tensor rank holds whole heads")
    plan = {}
    for name, _ in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            plan[name] = col()
        elif leaf in ("o_proj", "down_proj"):
            plan[name] = row()
    return plan


def _styles():
    """Column, row and input-preparing styles. Plain ones also for FP8 layers: a ``Float8Linear``
    computes on the local shards DTensor hands it (torchtitan's way for rowwise FP8). torchao's
    float8 styles, which all-gather FP8 activations for tensorwise, need every linear of a block
    converted, and the small K/V projections stay in bf16 here (:mod:`gpulaunch.parallel.fp8`)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
    )
    return ColwiseParallel, RowwiseParallel, PrepareModuleInput


def default_plan(model: nn.Module, tensor: int) -> dict:
    """The built-in plan for ``model`` (see the module docstring); a clear error when there is none."""
    from .reference_model import Llama
    if isinstance(model, Llama):
        return _reference_plan(model, tensor)
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    if {"q_proj", "o_proj", "down_proj"} <= names:
        return _hf_plan(model, tensor)
    raise ParallelError(
        f"Mesh(tensor={tensor}) needs a tensor plan, and there is no built-in one for {type(model).__name__} "
        "(built in: gpulaunch's reference Llama and Hugging Face Llama-style decoders). Pass tensor_plan= a dict "
        "of module name patterns to torch ParallelStyles, e.g. {'layers.*.mlp.w1': ColwiseParallel(), "
        "'layers.*.mlp.w2': RowwiseParallel()}, or a function fn(model, tensor_mesh).")


def apply_tensor_parallel(model: nn.Module, tensor_mesh, plan: TensorPlan = None) -> None:
    """Parallelize ``model`` in place over ``tensor_mesh`` with ``plan`` (default: :func:`default_plan`)."""
    from torch.distributed.tensor.parallel import parallelize_module

    if callable(plan) and not isinstance(plan, dict):
        plan(model, tensor_mesh)
        return
    if plan is None:
        plan = default_plan(model, tensor_mesh.size())
    if not isinstance(plan, dict) or not plan:
        raise ParallelError("tensor_plan= takes a non-empty dict {module name pattern: ParallelStyle} or a "
                            f"function fn(model, tensor_mesh); got {plan!r}")
    parallelize_module(model, tensor_mesh, plan)
