"""Tracking never fails a run: one warning line per kind of problem, and every MLflow call
that could block (a dead server retries for minutes) bounded in time."""

from __future__ import annotations

import sys
import threading

_warned: set[str] = set()


def warn_once(what: str, detail: str = "") -> None:
    """One line on stderr per kind of problem per process; tracking never raises into a run."""
    if what in _warned:
        return
    _warned.add(what)
    sys.stderr.write(f"gpulaunch: MLflow tracking: {what}{': ' + detail if detail else ''} "
                     "(the run itself continues; pass tracking=False or set "
                     "GPULAUNCH_TRACKING=0 to silence)\n")
    sys.stderr.flush()



def _bounded(fn, timeout: float, what: str):
    """Run ``fn`` in a daemon thread; its result, or None after ``timeout`` s or an error."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    th = threading.Thread(target=target, name=f"gpulaunch-mlflow-{what}", daemon=True)
    th.start()
    th.join(timeout)
    if th.is_alive():
        warn_once(f"{what} took longer than {timeout:g} s", "skipped")
        return None
    if "error" in box:
        e = box["error"]
        warn_once(f"{what} failed", f"{type(e).__name__}: {e}")
        return None
    return box.get("value")
