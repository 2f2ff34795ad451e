"""The asynchronous half of ``save_checkpoint(..., async_save=True)``.

Training stops only while the state is copied (staged) into host memory: pinned memory on a
GPU (a DMA copy), a plain copy on CPU. Torch's DCP ``async_save`` then writes the copy from a
background thread while the next steps run. The copy is taken synchronously on purpose: staging
in the background too would let the next optimizer step change parameters half-copied.

Publishing keeps the synchronous rules: the folder is ``.tmp-step_...`` until DCP's own finish
step (the coordinator writes ``.metadata`` only after every rank's files are written), then rank
0 writes ``COMPLETE``, renames and points ``latest`` at it, from the writer thread, at once. A
crash while writing leaves a ``.tmp-`` folder (removed by the next save) and ``latest`` on the
previous complete checkpoint.

One save is in flight at a time: the next ``save_checkpoint`` (sync or async) first waits for
the previous one, and so does the end of a rank's function (an ``atexit`` hook, which gpulaunch
ranks run before they exit) or an explicit ``wait_for_checkpoint()``.

The background writes' collectives go over a gloo group of their own (DCP needs a CPU backend,
and NCCL's default group must stay the training's).
"""

from __future__ import annotations

import atexit
import threading
from typing import Callable

import torch
import torch.distributed as dist

from . import _env

_group = None
_pending: "_Pending | None" = None
_lock = threading.Lock()


class _Pending:
    def __init__(self, future, final_dir: str, publish: Callable[[], None] | None):
        self.future = future
        self.final_dir = final_dir
        self.published = threading.Event()
        self.error: BaseException | None = None
        self._publish = publish
        future.add_done_callback(self._done)

    def _done(self, future) -> None:
        try:
            future.result()
            if self._publish is not None:
                self._publish()
        except BaseException as e:  # noqa: BLE001 - re-raised in wait(), on the training thread
            self.error = e
        finally:
            self.published.set()

    def wait(self) -> str:
        self.future.result()
        self.published.wait()
        if self.error is not None:
            raise self.error
        return self.final_dir


def _save_group():
    global _group
    if not _env.is_dist():
        return None
    if _group is None:
        _group = dist.new_group(backend="gloo")      # every rank calls save_checkpoint: ok
    return _group


def _stager():
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:                              # older torch: DCP's own default staging
        return None
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    # pinned host memory on a GPU; no shared memory, no background staging (see above)
    return DefaultStager(StagingOptions(cuda, False, False, cuda))


def start(state: dict, writer, final_dir: str, publish: Callable[[], None] | None) -> None:
    """Stage ``state`` now and write it in the background; ``publish`` (rank 0) runs when the
    whole checkpoint is on storage."""
    import torch.distributed.checkpoint as dcp
    global _pending
    stager = _stager()
    kwargs = {"async_stager": stager} if stager is not None else {}
    future = dcp.async_save(state, storage_writer=writer, process_group=_save_group(), **kwargs)
    if stager is not None:
        future.add_done_callback(lambda _: stager.close())
    with _lock:
        _pending = _Pending(future, final_dir, publish)


def track(future, final_dir: str) -> None:
    """Make another background job (a staged upload, ``parallel._staging``) the save in flight:
    waited for, and its error raised, like an asynchronous DCP write."""
    global _pending
    with _lock:
        _pending = _Pending(future, final_dir, None)


def wait_for_checkpoint(*, barrier: bool = True) -> str | None:
    """Block until the asynchronous save in flight (if any) is written and published on every
    rank (a barrier: rank 0 publishes), and return its folder. Call it on every rank. Raises
    what the background write raised."""
    global _pending
    with _lock:
        pending, _pending = _pending, None
    if pending is None:
        return None
    try:
        return pending.wait()
    finally:
        if barrier:
            _env.barrier()


def in_flight() -> bool:
    with _lock:
        return _pending is not None and not _pending.published.is_set()


def _wait_at_exit() -> None:
    try:
        # no barrier: a rank may be exiting on an error while its peers are not
        wait_for_checkpoint(barrier=False)
    except Exception as e:  # noqa: BLE001 - exiting anyway; say why the last save is missing
        print(f"gpulaunch: the last asynchronous checkpoint failed: {e}", flush=True)


atexit.register(_wait_at_exit)
