"""Each replica group's launch gets GPUs of its own (gpulaunch.ft.device_slots): the pure
bookkeeping, checked without a GPU. (On a CPU host there are no slots: for_host says None.)"""

from __future__ import annotations

import pytest

from gpulaunch.errors import ConfigurationError
from gpulaunch.ft.device_slots import DeviceSlots, visible_ids

pytestmark = pytest.mark.unit


class Launch:
    def __init__(self):
        self.finished = False

    def done(self):
        return self.finished


def test_groups_get_disjoint_gpus_and_a_spare_keeps_its_own():
    slots = DeviceSlots(["0", "1", "2", "3", "4", "5", "6", "7"], 2)
    assert len(slots) == 4 and slots.check(groups=3, spares=1) == 1
    taken = []
    for _ in range(4):                      # three groups and the spare
        i, env = slots.take()
        h = Launch()
        slots.bind(i, h)
        taken.append((env, h))
    assert [e for e, _ in taken] == ["0,1", "2,3", "4,5", "6,7"]
    assert slots.take() is None             # every slot held by a running launch
    slots.release(taken[1][1])              # group 1's ranks died: the caller let it go
    assert slots.take()[1] == "2,3"         # the next spare gets its GPUs


def test_a_slot_whose_launch_ended_is_free_again():
    slots = DeviceSlots(["a", "b"], 1)
    i, _ = slots.take()
    h = Launch()
    slots.bind(i, h)
    j, _ = slots.take()
    slots.bind(j, Launch())
    assert slots.take() is None
    h.finished = True                       # a spare that died while waiting
    assert slots.take() == (0, "a")


def test_too_few_gpus_for_the_groups_is_refused_and_spares_shrink_to_fit():
    slots = DeviceSlots(["0", "1", "2"], 2)                # one whole slot; GPU 2 unused
    with pytest.raises(ConfigurationError, match=r"2 replica group\(s\) of 2 rank\(s\) need 4"):
        slots.check(groups=2, spares=1)
    assert slots.check(groups=1, spares=1) == 0            # no room for a spare


def test_children_get_the_entries_this_process_was_given(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 5,GPU-abc")
    assert visible_ids(3) == ["4", "5", "GPU-abc"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_ids(2) == ["0", "1"]


def test_no_slots_on_a_cpu_host_or_when_the_caller_placed_the_groups(monkeypatch):
    import gpulaunch.hardware.host as host
    if host.detect().gpus:
        pytest.skip("this host has GPUs")
    assert DeviceSlots.for_host(1, {}) is None
    assert DeviceSlots.for_host(1, {"CUDA_VISIBLE_DEVICES": "3"}) is None
