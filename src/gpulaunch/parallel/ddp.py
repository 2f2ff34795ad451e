"""DDP behind ``prepare(strategy="ddp")``, and autocast for the strategies that cast in forward.

Mixed precision: DDP and ``none`` keep fp32 weights and run forward under ``torch.autocast``
(FSDP2 casts through its ``MixedPrecisionPolicy`` instead). Compilation: at world size 1 the
model is compiled before it is wrapped (one rank has no all-reduce to overlap, so forward and
backward become one graph each); at world size > 1 the DDP module is compiled, so that dynamo's
DDP optimizer splits the graph at DDP's bucket boundaries and each bucket's all-reduce starts
while backward goes on.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .compile import compile_in_place

__all__ = ["apply_ddp", "autocast_forward"]


def autocast_forward(forward, device_type: str, dtype: torch.dtype):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)

    return run


def apply_ddp(model: nn.Module, device: torch.device, dtype, compile_opts, one_rank: bool,
              ddp_kwargs: dict, process_group=None) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    kw = dict(ddp_kwargs)
    if device.type == "cuda":
        kw.setdefault("device_ids", [device.index])
    if process_group is not None:
        kw.setdefault("process_group", process_group)
    # gradients live in DDP's communication buckets instead of a second copy: saves 4 B/param
    kw.setdefault("gradient_as_bucket_view", True)
    inside = compile_opts is not None and one_rank
    if inside:   # nothing to overlap on one rank: the model compiled whole, as for 'none'
        if dtype is not None:
            model.forward = autocast_forward(model.forward, device.type, dtype)
        compile_in_place(model, compile_opts)
    wrapped = DDP(model, **kw)
    if dtype is not None and not inside:
        wrapped.forward = autocast_forward(wrapped.forward, device.type, dtype)
    if compile_opts is not None and not inside:   # the DDP module, split at its buckets
        compile_in_place(wrapped, compile_opts)
    return wrapped
