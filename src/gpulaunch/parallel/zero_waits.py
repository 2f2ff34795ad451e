"""ZeRO-3 without a host sync per module where nothing is sharded.

Where a parameter's partition group has one rank (one GPU; or hpZ/MiCS groups of one), DeepSpeed
fetches it with a *no-gather* handle: the parameter's storage is its own partition, made visible
again with a ``.to(device, non_blocking=True)`` that is no copy at all when the partition is on
the GPU already. The handle's ``wait()`` then still blocks the host until the whole current CUDA
stream has drained (``current_stream().synchronize()``), once per fetched module, forward and
backward. The GPU runs dry at every layer while the host prepares the next one: profiled on an
H100 (torch 2.11, DeepSpeed 0.19.8, the TRL ZeRO-3 recipe on a 1B Llama, each decoder layer one
ZeRO-3 unit), 28 such syncs a step and the GPU idle for about a fifth of the step.

``event_waits()`` makes those waits what they need to be: the stream that uses the parameter
waits, on the GPU, for an event recorded where the handle made it visible; the host goes on
queueing work. DeepSpeed's own ``wait()`` still runs (its status flags, its idempotence), told
that the device resolves the data dependency for the length of that call only.
"""

from __future__ import annotations

import contextlib
import threading

import torch

__all__ = ["event_waits"]

_MARK = "_gpulaunch_event_wait"
_lock = threading.Lock()


@contextlib.contextmanager
def _dependency_resolved(accelerator):
    """DeepSpeed's ``wait()`` skips its stream sync when the accelerator says the device orders
    the work itself; say so for this one call (an instance attribute, removed after)."""
    accelerator.resolves_data_dependency = lambda: True
    try:
        yield
    finally:
        del accelerator.resolves_data_dependency


def _wrap(cls, accelerator) -> None:
    original_init, original_wait = cls.__init__, cls.wait

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        # after the handle's .to(device, non_blocking=True), on the stream current here
        self._gpulaunch_ready = torch.cuda.Event()
        self._gpulaunch_ready.record()

    def wait(self, *args, **kwargs):
        ready = getattr(self, "_gpulaunch_ready", None)
        if ready is None:          # made before event_waits(): DeepSpeed's own wait
            return original_wait(self, *args, **kwargs)
        torch.cuda.current_stream().wait_event(ready)
        with _lock, _dependency_resolved(accelerator):
            return original_wait(self, *args, **kwargs)

    setattr(wait, _MARK, True)
    cls.__init__, cls.wait = __init__, wait


def event_waits() -> bool:
    """Make DeepSpeed's no-gather handles (``NoGatherHandle``, ``NoGatherCoalescedHandle``) wait
    with a CUDA event instead of a host sync; idempotent, process-wide (every ZeRO-3 engine of
    the process). True if they wait with events now; False where nothing applies (no CUDA,
    DeepSpeed missing, an accelerator that already orders the work, or a DeepSpeed without
    these classes)."""
    if not torch.cuda.is_available():
        return False
    try:
        from deepspeed.accelerator import get_accelerator
        from deepspeed.runtime.zero import partition_parameters as pp
    except ImportError:
        return False
    accelerator = get_accelerator()
    if accelerator.device_name() != "cuda" or accelerator.resolves_data_dependency():
        return False
    classes = [getattr(pp, n, None) for n in ("NoGatherHandle", "NoGatherCoalescedHandle")]
    if not all(c is not None and callable(getattr(c, "wait", None)) for c in classes):
        return False
    for cls in classes:
        if not getattr(cls.wait, _MARK, False):
            _wrap(cls, accelerator)
    return True
