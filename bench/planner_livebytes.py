"""Peak live tensor bytes on any device (CPU included), the CPU stand-in for
``torch.cuda.max_memory_allocated``.

Why: the planner's memory model should be calibrated on this no-GPU machine, not fitted to GPU
numbers afterwards. Bytes held by live tensors are device independent (same shapes, same dtypes,
same autograd graph); only allocator rounding and kernel workspaces differ, and those are small.

How: a TorchDispatchMode sees every tensor an op returns; each new storage is counted once and a
weakref callback subtracts it when the storage dies. Storages alive before tracking started
(parameters, buffers) are counted through ``baseline``.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _round512(n: int) -> int:
    # The CUDA caching allocator rounds every block up to 512 bytes; do the same so small
    # tensors are counted as they would be on a GPU.
    return (n + 511) // 512 * 512


class LiveBytes(TorchDispatchMode):
    def __init__(self, baseline_tensors=()):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: dict[int, weakref.ref] = {}
        for t in baseline_tensors:
            self._track(t)
        self.baseline = self.live

    def _track(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        st = t.untyped_storage()
        ptr, n = st.data_ptr(), st.nbytes()
        if n == 0 or ptr in self._seen:
            return
        n = _round512(n)
        self.live += n
        self.peak = max(self.peak, self.live)

        def _gone(_ref, ptr=ptr, n=n):
            self.live -= n
            self._seen.pop(ptr, None)

        self._seen[ptr] = weakref.ref(st, _gone)

    def reset_peak(self) -> None:
        self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._track(t)
        return out
