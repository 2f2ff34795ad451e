"""The caller's active runs: every run still going when the interpreter exits is stopped (the
agents' stdin pipes cover a caller that dies without running atexit)."""

from __future__ import annotations

import atexit
import threading

from ..common.records import StopReason


class ActiveRuns:
    def __init__(self):
        self._runs: set = set()
        self._lock = threading.Lock()

    def add(self, run) -> None:
        with self._lock:
            self._runs.add(run)

    def discard(self, run) -> None:
        with self._lock:
            self._runs.discard(run)

    def runs(self) -> list:
        with self._lock:
            return list(self._runs)

    def stop_all(self) -> None:
        for run in self.runs():
            try:
                run.stop(StopReason.CANCELLED)
            except Exception:  # noqa: BLE001 - the interpreter is exiting
                pass


ACTIVE = ActiveRuns()
atexit.register(ACTIVE.stop_all)
