"""Side concerns on a node: the agent runs each extension of the launch record here.

A run callback (``caller.callbacks``) that needs work on every node (tracking: hand the ranks
the MLflow run's ids, sample the node's GPUs) puts its fields in ``LaunchRecord.extensions``
with ``"hook": "<module>"``; that module's ``node_hook(record, run, fields, node_rank)`` returns
an object with any of ``env()``, ``on_ranks_started()``, ``status_fields()``, ``stop()`` (or
None to do nothing). The agent knows no hook by name; a failing hook costs a warning.
"""

from __future__ import annotations

import importlib
import sys


class NodeHooks:
    def __init__(self, record, run, node_rank: int):
        self.items = []
        for name, fields in (record.extensions or {}).items():
            module = (fields or {}).get("hook")
            if not module:
                continue
            try:
                hook = importlib.import_module(module).node_hook(record, run, fields, node_rank)
            except Exception as e:  # noqa: BLE001
                _warn(name, "setup", e)
                continue
            if hook is not None:
                self.items.append((name, hook))

    def _each(self, method: str):
        for name, hook in self.items:
            fn = getattr(hook, method, None)
            if fn is None:
                continue
            try:
                yield fn()
            except Exception as e:  # noqa: BLE001
                _warn(name, method, e)

    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for part in self._each("env"):
            out.update(part or {})
        return out

    def status_fields(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for part in self._each("status_fields"):
            out.update(part or {})
        return out

    def on_ranks_started(self) -> None:
        list(self._each("on_ranks_started"))

    def stop(self) -> None:
        list(self._each("stop"))


def _warn(name: str, what: str, e: BaseException) -> None:
    sys.stderr.write(f"gpulaunch-agent: {name}: {what} failed: {type(e).__name__}: {e}\n")
    sys.stderr.flush()
