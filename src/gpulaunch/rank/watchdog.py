"""In-rank stall detection for ``hang_timeout=``.

A thread samples the main thread's Python stack once a second. If the stack (code objects and
line numbers, innermost to outermost) has not changed for ``timeout`` seconds and the user did
not call ``runtime.heartbeat()`` meanwhile, the rank is stuck: waiting in a collective that a
peer never joined, a deadlocked data loader, a ``sleep`` that should not be there. It then
writes ``rank<r>.stuck``; the node agent sees that file, has every rank dump its stack
(faulthandler, which works even while a thread sits inside C code) and tears the run down.

On GPU ranks the same thread also writes the rank's NCCL flight record
(``rank<r>.nccl_trace.pkl``: the last collectives each communicator started and finished) when
it reports itself stuck, and when the agent asks every rank for it (``dump_request`` in the
attempt directory). A thread, because the main thread is then inside a CUDA or NCCL wait,
where a Python signal handler never runs.

A loop that keeps moving between lines is progress, not a hang; ``hang_timeout`` must exceed
the longest single operation of the training step.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from pathlib import Path

from ..common import private
from ..common.records import StuckReport

_beats = 0


def heartbeat() -> None:
    """Tell the watchdog this rank is making progress (for single long operations)."""
    global _beats
    _beats += 1


def _signature(frame) -> tuple:
    sig = []
    while frame is not None:
        sig.append((id(frame.f_code), frame.f_lineno))
        frame = frame.f_back
    return tuple(sig)


DUMP_REQUEST = "dump_request"


def dump_nccl_trace(path: Path) -> bool:
    """Write this process's NCCL flight record to ``path`` (False when there is none: no NCCL
    process group, a torch without the recorder)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()
                and "nccl" in str(dist.get_backend()).lower()):
            return False
        from torch._C._distributed_c10d import _dump_nccl_trace
        data = _dump_nccl_trace()
    except Exception:  # noqa: BLE001 - a diagnostic: never fail the rank for it
        return False
    tmp = path.with_name(f".{path.name}.tmp")
    with private.open_file(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return True


class StallWatchdog(threading.Thread):
    def __init__(self, timeout: float, attempt_dir: Path, rank: int, interval: float = 1.0):
        super().__init__(name="gpulaunch-stall-watchdog", daemon=True)
        self.timeout = timeout
        self.attempt_dir = Path(attempt_dir)
        self.stuck_file = str(self.attempt_dir / f"rank{rank}.stuck")
        self.trace_file = self.attempt_dir / f"rank{rank}.nccl_trace.pkl"
        self._traced = False
        self.rank = rank
        self.interval = min(interval, max(timeout / 10, 0.1))
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        main_id = threading.main_thread().ident
        last = None
        last_beats = _beats
        since = time.monotonic()
        reported = False
        while not self._stop_event.wait(self.interval):
            if not self._traced and (self.attempt_dir / DUMP_REQUEST).exists():
                self._traced = dump_nccl_trace(self.trace_file) or True
            frame = sys._current_frames().get(main_id)
            if frame is None:
                return
            sig = _signature(frame)
            now = time.monotonic()
            if sig != last or _beats != last_beats:
                last, last_beats, since = sig, _beats, now
                if reported:
                    reported = False
                    try:
                        os.unlink(self.stuck_file)
                    except OSError:
                        pass
                continue
            if not reported and now - since >= self.timeout:
                where = "".join(traceback.format_stack(frame)[-6:])
                if not self._traced:
                    self._traced = dump_nccl_trace(self.trace_file) or True
                record = StuckReport(rank=self.rank, stuck_for=round(now - since, 1),
                                     since_unix=time.time() - (now - since), where=where)
                tmp = self.stuck_file + ".tmp"
                with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                    f.write(record.to_json())
                os.replace(tmp, self.stuck_file)
                reported = True
            del frame
