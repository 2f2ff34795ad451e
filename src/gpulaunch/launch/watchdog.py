"""In-rank stall detection for ``hang_timeout=``.

A thread samples the main thread's Python stack once a second. If the stack (code objects and
line numbers, innermost to outermost) has not changed for ``timeout`` seconds and the user did
not call ``runtime.heartbeat()`` meanwhile, the rank is stuck: waiting in a collective that a
peer never joined, a deadlocked data loader, a ``sleep`` that should not be there. It then
writes ``rank<r>.stuck``; the node agent sees that file, has every rank dump its stack
(faulthandler, which works even while a thread sits inside C code) and tears the run down.

A loop that keeps moving between lines is progress, not a hang; ``hang_timeout`` must exceed
the longest single operation of the training step.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback

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


class StallWatchdog(threading.Thread):
    def __init__(self, timeout: float, stuck_file: str, rank: int, interval: float = 1.0):
        super().__init__(name="gpulaunch-stall-watchdog", daemon=True)
        self.timeout = timeout
        self.stuck_file = stuck_file
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
                record = {"rank": self.rank, "stuck_for": round(now - since, 1),
                          "since_unix": time.time() - (now - since), "where": where}
                tmp = self.stuck_file + ".tmp"
                with open(tmp, "w") as f:
                    json.dump(record, f)
                os.replace(tmp, self.stuck_file)
                reported = True
            del frame
