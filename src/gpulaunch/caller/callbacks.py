"""Run callbacks: side concerns of a launch (MLflow tracking, the notebook panel) hook into the
one pipeline here, so no backend and no entry point names them.

    on_launch(ctx)       the run directory exists, nothing has started: prepare (in a thread
                         if slow); return fields for the node agents, or None
    on_placed(spec)      Ray: the layout is known (placement done), no rank started yet
    on_start(run)        the backend started (``run.spec`` is the final layout)
    on_poll(run)         the caller polled the run (often: keep it cheap, throttle yourself)
    on_end(run, state)   the run is over (any outcome); must not raise, must be bounded

Fields returned by ``on_launch`` travel in the launch record's ``extensions[name]``; they must
include ``"hook"``: a module whose ``node_hook(record, run, fields, node_rank)`` the node agent
calls before it starts the ranks (``backends.local.node_hooks``). A backend whose agents cannot
read the caller's run directory (Ray) asks ``node_fields(hosts)`` instead, which may wait for
the callback's setup to finish.
"""

from __future__ import annotations

import dataclasses
import sys

from ..common.records import Entry, LaunchSpec, RunState
from ..common.rundir import RunDir


@dataclasses.dataclass
class LaunchContext:
    """What a callback knows about a launch before it starts."""

    run: RunDir
    label: str
    spec: LaunchSpec
    entry: Entry
    options: object                      # the LaunchOptions
    remote: bool = False                 # node agents cannot see ``run`` (multi-node)


class RunCallback:
    """Base class: every hook is optional."""

    name = "callback"

    def on_launch(self, ctx: LaunchContext) -> dict | None:
        return None

    def node_fields(self, hosts: list[str]) -> dict | None:
        """Fields for node agents (on ``hosts``) that cannot read the caller's run directory
        (may block until the callback's setup is done)."""
        return None

    def on_placed(self, spec: LaunchSpec) -> None:
        pass

    def on_start(self, run) -> None:
        pass

    def on_poll(self, run) -> None:
        pass

    def on_end(self, run, state: RunState) -> None:
        pass


class Callbacks:
    """The callbacks of one run, called in order; a failing callback costs a warning."""

    def __init__(self, callbacks: list[RunCallback]):
        self.items = list(callbacks)
        self.extensions: dict[str, dict] = {}
        self._ended = False

    def _guard(self, cb: RunCallback, what: str, fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - a side concern never fails the run
            sys.stderr.write(f"gpulaunch: {cb.name}: {what} failed: {type(e).__name__}: {e}\n")
            return None

    def on_launch(self, ctx: LaunchContext) -> None:
        for cb in self.items:
            fields = self._guard(cb, "on_launch", lambda cb=cb: cb.on_launch(ctx))
            if fields:
                self.extensions[cb.name] = fields

    def node_extensions(self, hosts: list[str]) -> dict[str, dict]:
        """Extensions for node agents without the caller's run directory (Ray)."""
        out = {}
        for cb in self.items:
            fields = self._guard(cb, "node_fields", lambda cb=cb: cb.node_fields(hosts))
            if fields:
                out[cb.name] = fields
        return out

    def on_placed(self, spec: LaunchSpec) -> None:
        for cb in self.items:
            self._guard(cb, "on_placed", lambda cb=cb: cb.on_placed(spec))

    def on_start(self, run) -> None:
        for cb in self.items:
            self._guard(cb, "on_start", lambda cb=cb: cb.on_start(run))

    def on_poll(self, run) -> None:
        for cb in self.items:
            self._guard(cb, "on_poll", lambda cb=cb: cb.on_poll(run))

    def on_end(self, run, state: RunState) -> None:
        if self._ended:
            return
        self._ended = True
        for cb in self.items:
            self._guard(cb, "on_end", lambda cb=cb: cb.on_end(run, state))

    def find(self, name: str) -> RunCallback | None:
        return next((cb for cb in self.items if cb.name == name), None)
