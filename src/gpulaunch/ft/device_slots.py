"""Which GPUs each replica-group launch gets on this host.

Every replica group (and the warm spare) is a launch of its own; without this, each would see
the same first ``ranks_per_group`` GPUs, and on an 8-GPU host two groups would share GPU 0
(NCCL refuses two ranks of one communicator on one device, and memory would be shared). Here
the host's visible GPUs are cut into slots of ``ranks_per_group``; each launch takes a free
slot (its ranks get it as ``CUDA_VISIBLE_DEVICES``), keeps it for its life (a spare keeps its
slot when it takes a failed group's place), and gives it back when the caller lets the launch
go (finished, failed, cancelled).

Pure bookkeeping: the owner of a slot is whatever object the caller binds to it (a run
handle); a slot whose owner reports ``done()`` is free again.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import ConfigurationError


class DeviceSlots:
    """The host's GPUs as slots of ``per_group`` devices (CUDA_VISIBLE_DEVICES entries)."""

    def __init__(self, devices: list[str], per_group: int):
        self.per_group = per_group
        self.devices = list(devices)
        self.slots = [devices[i * per_group:(i + 1) * per_group]
                      for i in range(len(devices) // per_group)]
        self._owner: dict[int, Any] = {}

    @classmethod
    def for_host(cls, per_group: int, extra_env: dict) -> "DeviceSlots | None":
        """Slots of this host's visible GPUs; None on a host without GPUs, or when the caller
        placed the groups itself (``CUDA_VISIBLE_DEVICES`` in ``extra_env``)."""
        if "CUDA_VISIBLE_DEVICES" in extra_env:
            return None
        from ..hardware.host import detect
        gpus = detect().gpus
        if not gpus:
            return None
        return cls(visible_ids(len(gpus)), per_group)

    def __len__(self) -> int:
        return len(self.slots)

    def check(self, groups: int, spares: int) -> int:
        """Refuse a run whose groups cannot each have their own GPUs; return how many spares
        fit beside them (fewer than asked when the host is short: a spare is an optimisation)."""
        if groups > len(self.slots):
            raise ConfigurationError(
                f"{groups} replica group(s) of {self.per_group} rank(s) need "
                f"{groups * self.per_group} GPUs, one set per group; this host shows "
                f"{len(self.devices)} (CUDA_VISIBLE_DEVICES). Use fewer groups or fewer ranks "
                "per group.")
        return min(spares, len(self.slots) - groups)

    def take(self) -> tuple[int, str] | None:
        """A free slot and its ``CUDA_VISIBLE_DEVICES`` value, or None when every slot is
        held by a launch still running."""
        for i, devices in enumerate(self.slots):
            owner = self._owner.get(i)
            if owner is not None and _done(owner):
                del self._owner[i]
                owner = None
            if owner is None:
                self._owner[i] = _RESERVED
                return i, ",".join(devices)
        return None

    def bind(self, slot: int, owner: Any) -> None:
        self._owner[slot] = owner

    def release(self, owner: Any) -> None:
        """The caller let ``owner`` go (its ranks are dead or ending): its slot is free."""
        for i, o in list(self._owner.items()):
            if o is owner:
                del self._owner[i]

    def held(self) -> int:
        return len(self._owner)


_RESERVED = object()     # taken, the launch not yet bound (between take() and bind())


def _done(owner) -> bool:
    try:
        return owner is not _RESERVED and bool(owner.done())
    except Exception:  # noqa: BLE001 - an owner that cannot say is treated as still running
        return False


def visible_ids(count: int) -> list[str]:
    """This process's visible GPUs as ``CUDA_VISIBLE_DEVICES`` entries for its children: the
    entries it was given itself (indices or UUIDs), else ``0 .. count-1``."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is not None:
        tokens = [t.strip() for t in raw.split(",") if t.strip()]
        return tokens[:count]
    return [str(i) for i in range(count)]
