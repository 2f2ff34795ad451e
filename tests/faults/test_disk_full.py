"""A checkpoint save that fills the disk says "No space left on device" and names the folder,
on a real, small file system (a 2 MiB tmpfs), cold and warm (keep_alive pool)."""

from __future__ import annotations

import errno
import subprocess

import pytest

import gpulaunch
from gpulaunch import distributed


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def save_too_much(root):
    import torch

    from gpulaunch import runtime as rt
    from gpulaunch.parallel import prepare, save_checkpoint
    rt.init()
    p = prepare(torch.nn.Linear(512, 512), lambda ps: torch.optim.AdamW(ps), strategy="ddp")
    p.backward(p.model(torch.ones(4, 512)).sum())
    p.step()                           # weights + two AdamW moments: ~3 MiB > the 2 MiB disk
    save_checkpoint(root, p, step=1)


@pytest.mark.parametrize("keep_alive", [False, 30], ids=["cold", "warm"])
def test_a_full_disk_during_a_checkpoint_names_the_cause_and_the_folder(small_disk, keep_alive):
    fn = distributed(gpus=2, keep_alive=keep_alive, stream_logs="none")(save_too_much)
    try:
        with pytest.raises(OSError) as info:
            fn.distributed(str(small_disk / "ckpts"))
    finally:
        gpulaunch.shutdown()
    e = info.value
    assert e.errno == errno.ENOSPC, repr(e)
    assert "No space left on device" in str(e) and str(small_disk / "ckpts") in str(e), str(e)
    assert "saving checkpoint step 1" in str(e)
