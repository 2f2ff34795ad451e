"""Peak live tensor bytes on any device (CPU included), the CPU stand-in for
``torch.cuda.max_memory_allocated``.

Why: the planner's memory model should be calibrated on this no-GPU machine, not fitted to GPU
numbers afterwards. Bytes held by live tensors are device independent (same shapes, same dtypes,
same autograd graph); only allocator rounding and kernel workspaces differ, and those are small.

How: a TorchDispatchMode sees every tensor an op returns and remembers its storage (weakly). After
every op the live total is re-summed from the storages' *current* sizes, because FSDP2 frees and
re-allocates its all-gather buffers by resizing storages in place (a count taken at allocation
would never see those bytes go away).
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
        self._stores: dict[int, weakref.ref] = {}
        self.peak = 0
        self.peak_op = None  # the op that allocated the peak: tells which phase of the step it was
        for t in baseline_tensors:
            self._track(t)
        self.baseline = self.live

    def _track(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        # A wrapper subclass (DTensor) owns no memory itself; its inner tensors do, and the ops that
        # make them run below this mode, so reach them through __tensor_flatten__.
        if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
            for name in t.__tensor_flatten__()[0]:
                self._track(getattr(t, name))
            return
        try:
            st = t.untyped_storage()
        except RuntimeError:
            return
        key = id(st)
        if key not in self._stores:
            self._stores[key] = weakref.ref(st, lambda _r, key=key: self._stores.pop(key, None))

    @property
    def live(self) -> int:
        seen, total = set(), 0
        for ref in list(self._stores.values()):
            st = ref()
            if st is None:
                continue
            try:
                ptr, n = st.data_ptr(), st.nbytes()
            except RuntimeError:  # storage freed under us ("invalid python storage")
                continue
            if n and ptr not in seen:
                seen.add(ptr)
                total += _round512(n)
        return total

    def reset_peak(self) -> None:
        self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._track(t)
        live = self.live
        if live > self.peak:
            self.peak, self.peak_op = live, str(func)
        return out
