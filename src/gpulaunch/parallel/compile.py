"""``torch.compile`` where each strategy gains most from it, and activation checkpointing before it.

Where compilation goes (``prepare(..., compile=True)``):

* ``none``: the whole model, in place (``nn.Module.compile``: the parameter names, hence the
  checkpoints, do not change).
* ``ddp``: at world size 1 the model before it is wrapped, so the whole forward and backward are
  one graph each (one rank has no all-reduce to overlap); at world size > 1 the DDP module, so
  that dynamo's DDP optimizer splits the graph at DDP's bucket boundaries and each bucket's
  all-reduce starts while backward goes on.
* ``fsdp``: torchtitan's order, activation checkpointing, then each block compiled, then
  ``fully_shard`` per block; then the root module's forward too, so that the embedding, the
  head and the loss are compiled as well. FSDP2's hooks run eagerly between the graphs
  (``torch._dynamo.config.skip_fsdp_hooks``, on by default), so every block keeps its own
  all-gather / reduce-scatter overlap.
* ``zero1/2``: DeepSpeed's own ``engine.compile()``, which compiles the whole wrapped module in
  place (ZeRO-1/2 hook no module).
* ``zero3``: each block one ZeRO-3 unit (DeepSpeed's leaf modules: gathered whole before its
  forward and backward, nothing inside it hooked), then each block's forward compiled; the rest
  stays eager. ZeRO-3 otherwise hooks every submodule and a compiled block would break its graph
  at each hook; and with torch's ``F.linear`` (``parallel/zero.py``'s ``plain_linear`` says why).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ._env import ParallelError
from .activation_checkpoint import apply_activation_checkpointing  # noqa: F401 - its old home

__all__ = ["apply_activation_checkpointing", "compile_in_place", "compile_options"]

CompileArg = bool | dict | None


def compile_options(compile: CompileArg) -> dict[str, Any] | None:
    """``prepare(compile=...)`` as ``torch.compile`` keyword arguments, or None for eager."""
    if compile is None or compile is False:
        return None
    if compile is True:
        return {}
    if isinstance(compile, dict):
        return dict(compile)
    raise ParallelError(f"compile= takes True/False or a dict of torch.compile options "
                        f"(e.g. {{'mode': 'max-autotune-no-cudagraphs'}}), got {compile!r}")


def compile_in_place(module: nn.Module, options: dict[str, Any]) -> None:
    """``module.compile(**options)``: compiles the module's call in place, so its parameters keep
    their names (``torch.compile(module)`` would add an ``_orig_mod.`` prefix)."""
    module.compile(**options)
