"""A function's ranks start as torchrun's would, cold and warm: a torch seed of their own
(different per rank, and per call, as fresh processes have), stderr on the caller's stderr,
TORCHELASTIC_ERROR_FILE and ROLE_NAME set."""

from __future__ import annotations

import pytest

import gpulaunch
from gpulaunch import distributed


def probe():
    import os
    import sys

    import torch
    print(f"stderr line of rank {os.environ['RANK']}", file=sys.stderr)
    return (torch.initial_seed(), torch.rand(1).item(), os.environ.get("ROLE_NAME"),
            bool(os.environ.get("TORCHELASTIC_ERROR_FILE")))


@pytest.mark.parametrize("keep_alive", [False, 30], ids=["cold", "warm"])
def test_ranks_start_like_torchrun_ranks(keep_alive, capfd):
    fn = distributed(gpus=2, keep_alive=keep_alive)(probe)
    try:
        first, second = fn.distributed(), fn.distributed()
    finally:
        gpulaunch.shutdown()
    out, err = capfd.readouterr()
    seeds = [r[0] for r in first + second]
    assert len(set(seeds)) == 4, seeds          # per rank and per call, as fresh processes
    assert len({r[1] for r in first}) == 2      # unseeded torch.rand differs per rank
    assert all(r[2] == "default" and r[3] for r in first + second)
    for r in (0, 1):
        assert f"[rank {r}] stderr line of rank {r}" in err
        assert f"stderr line of rank {r}" not in out
