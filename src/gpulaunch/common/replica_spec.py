"""``Replicas``: what ``@distributed(replicas=...)`` asks for, as one frozen, checked record.

    @distributed(replicas=2)                              # two groups, each replaced up to 3 times
    @distributed(replicas=(1, 2))                         # elastic: on with 1, back to 2
    @distributed(replicas=ft.Replicas((1, 2), node_lost_timeout=30, capacity=cap))

The decorator's other settings describe one replica group's launch (``timeout``, ``env``,
``stream_logs``, ...); this record holds what belongs to the run of several groups. Pure: it
starts nothing and imports neither torch nor torchft, so that a bad value is refused when the
function is decorated, before any process exists.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import ConfigurationError


@dataclasses.dataclass(frozen=True)
class Replicas:
    """A fault-tolerant run of replica groups (``gpulaunch.ft``, on torchft).

    ``size``: the number of groups, or ``(min, max)`` for an elastic run. ``max_group_restarts``:
    how many times each group is replaced after a failure while the others keep stepping.
    ``node_lost_timeout`` (elastic only): seconds a failed group may wait for capacity before the
    run goes on smaller (default 60). ``capacity`` (elastic only): ``ft.Capacity``, an int or a
    callable giving how many groups may run now. ``lighthouse``: the address of a torchft
    lighthouse already running (default: gpulaunch starts one on loopback and supervises it).
    """

    size: int | tuple[int, int] = 2
    max_group_restarts: int = 3
    node_lost_timeout: float | None = None
    capacity: Any = None
    lighthouse: str | None = None

    def __post_init__(self):
        size = self.size
        if isinstance(size, list):
            size = tuple(size)
            object.__setattr__(self, "size", size)
        if isinstance(size, tuple):
            if (len(size) != 2 or not all(_is_int(v) for v in size)
                    or not 1 <= size[0] <= size[1]):
                raise ConfigurationError(
                    f"replicas={size!r}: an elastic size is (min, max) with 1 <= min <= max, "
                    "e.g. replicas=(1, 2)")
        elif not _is_int(size) or size < 1:
            raise ConfigurationError(
                f"replicas={size!r}: give the number of replica groups (an int >= 1), "
                "(min, max) for an elastic size, or gpulaunch.ft.Replicas(...)")
        if not _is_int(self.max_group_restarts) or self.max_group_restarts < 0:
            raise ConfigurationError(f"Replicas(max_group_restarts={self.max_group_restarts!r}):"
                                     " an int >= 0")
        elastic = isinstance(size, tuple)
        if self.node_lost_timeout is not None:
            if not elastic:
                raise ConfigurationError(
                    "Replicas(node_lost_timeout=...) is for an elastic size: give "
                    "size=(min, max); a fixed size waits for every replacement")
            if (isinstance(self.node_lost_timeout, bool)
                    or not isinstance(self.node_lost_timeout, (int, float))
                    or self.node_lost_timeout <= 0):
                raise ConfigurationError(f"Replicas(node_lost_timeout="
                                         f"{self.node_lost_timeout!r}): seconds > 0")
        if self.capacity is not None and not elastic:
            raise ConfigurationError("Replicas(capacity=...) is for an elastic size: give "
                                     "size=(min, max)")
        if self.lighthouse is not None and (not isinstance(self.lighthouse, str)
                                            or not self.lighthouse.strip()):
            raise ConfigurationError(f"Replicas(lighthouse={self.lighthouse!r}): an address "
                                     "such as 'http://head:29510'")

    @classmethod
    def of(cls, value) -> "Replicas | None":
        """``None``, an int, ``(min, max)`` or a ``Replicas``, as a checked ``Replicas``."""
        if value is None or isinstance(value, cls):
            return value
        return cls(size=value)

    @property
    def elastic(self) -> bool:
        return isinstance(self.size, tuple)

    def run_kwargs(self) -> dict:
        """The keyword arguments of :func:`gpulaunch.ft.run_replicas` this record stands for."""
        out = {"replicas": self.size, "max_group_restarts": self.max_group_restarts}
        for name in ("node_lost_timeout", "capacity", "lighthouse"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# Settings of @distributed that cannot be combined with replicas=, each with the reason and what
# to do instead (checked at decoration: ``conflicts``).
_CONFLICTS = {
    "remote": "replica groups run on this host for now (each group is a local launch that "
              "gpulaunch replaces itself); run ft.run_replicas on the Ray head instead",
    "keep_alive": "a kept-alive pool is one set of ranks; replica groups are replaced one by "
                  "one: drop keep_alive",
    "max_restarts": "max_restarts restarts every rank together; with replicas= each failed "
                    "group is replaced alone: use replicas=ft.Replicas(n, "
                    "max_group_restarts=...)",
}


def conflicts(options) -> None:
    """Refuse, with the reason and the fix, settings that do not go with ``replicas=``."""
    if options.replicas is None:
        return
    for name, why in _CONFLICTS.items():
        value = getattr(options, name)
        if value not in (None, False, 0):
            raise ConfigurationError(f"replicas= with {name}={value!r}: {why}.")
