"""The replica-group supervisor's elastic size (``run_replicas(replicas=(min, max))``): apply
:func:`elastic.decide` at each poll (start what the capacity allows, declare lost what was not
started within ``node_lost_timeout``, stop below ``min``) and record each :class:`SizeChange`.
A mixin of :class:`~gpulaunch.ft.replicas.ReplicaGroups`, whose state it reads and updates."""

from __future__ import annotations

import time

from .elastic import ReplicasBelowMinError, SizeChange, Slot, decide
from .result import read_steps


class ElasticSizing:
    """``_resize`` and ``_record_growth`` of ReplicaGroups (its fields: ``replicas``,
    ``attempts``, ``_state``, ``_since``, ``_launched``, ``_growing``, ``size``,
    ``size_changes``, ``elastic``, ``_capacity``, ``failures``, ``results``, ``ft_dir``)."""

    def _resize(self) -> None:
        """Apply :func:`elastic.decide`: start what the capacity allows, declare lost what was
        not started in time, stop the run below min."""
        slots = [Slot(r, self._state[r], self._since.get(r, 0.0),
                      r not in self._launched or self.attempts[r] < self.max_group_restarts)
                 for r in range(self.replicas)]
        committed = any(read_steps(self.ft_dir, r)[-1:] for r in range(self.replicas))
        capacity = int(self._capacity())
        d = decide(slots, now=time.monotonic(), capacity=capacity, min_size=self.elastic.min,
                   node_lost_timeout=self.elastic.node_lost_timeout,
                   ending=bool(self.results), committed=committed)
        for r in d.lose:
            self._state[r] = "lost"
            why = ("its restart budget is spent" if self.attempts[r] >= self.max_group_restarts
                   else f"no capacity within node_lost_timeout="
                        f"{self.elastic.node_lost_timeout:g} s (capacity {capacity})")
            self.size_changes.append(SizeChange(
                at=time.time(), step=self._run_step(), from_size=self.size,
                to_size=self.size - 1, replica=r,
                reason=f"replica {r} failed and was not started again: {why}"))
            self.size -= 1
        if d.fail:
            self.stop()
            raise ReplicasBelowMinError(
                f"elastic run stopped: {d.fail}; every replica group was stopped. Size "
                f"changes: {[str(c) for c in self.size_changes] or 'none'}")
        for r in d.start:
            grow = self._state[r] == "lost"
            if r in self._launched:
                self.attempts[r] += 1
            for f in self.failures:
                if f.replica == r and f.attempt == self.attempts[r] - 1:
                    f.restarted = True
            self._state[r] = "running"
            self._since.pop(r, None)
            if grow:
                self._growing[r] = self.attempts[r]
            self._launch(r)

    def _record_growth(self) -> None:
        """A group started after its place was lost grows the run at its first commit."""
        for r, a in list(self._growing.items()):
            first = next((rec for rec in read_steps(self.ft_dir, r) if rec.get("a") == a), None)
            if first is None:
                continue
            del self._growing[r]
            healed = f", healed to step {first['healed_to']}" if "healed_to" in first else ""
            self.size_changes.append(SizeChange(
                at=first["t"], step=first["step"], from_size=self.size, to_size=self.size + 1,
                replica=r, reason=f"capacity returned: replica {r} joined{healed}"))
            self.size += 1
