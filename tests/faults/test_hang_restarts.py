"""Hangs and restarts together (issue 17): the hang watchdog watches every attempt, and a hang
that a restart recovered from never fails the run. Real CPU ranks that really stall."""

from __future__ import annotations

import pytest
from conftest import assert_no_survivors, latest_run_dir

from gpulaunch import distributed
from gpulaunch.common.rundir import RunDir
from gpulaunch.errors import HangError

pytestmark = pytest.mark.slow


def _hangs_in(attempts: str):
    import os
    import time
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt in attempts.split(",") and os.environ["RANK"] == "1":
        time.sleep(3600)                     # stuck: the watchdog must see it
    return (int(os.environ["RANK"]), int(attempt))


def test_hang_in_attempt_0_then_success_returns_the_results(gpulaunch_home):
    out = distributed(gpus=2, hang_timeout=3, max_restarts=1)(_hangs_in).distributed("0")
    assert out == [(0, 1), (1, 1)]
    run = RunDir(latest_run_dir(gpulaunch_home))
    assert run.hang() is not None and run.hang().attempt == 0   # it did hang, and recovered
    assert_no_survivors(run.path)


def test_a_hang_in_the_last_attempt_is_reported_with_that_attempts_stacks(gpulaunch_home):
    # timeout=: without the watchdog on attempt 1, this would end as a timeout, not a hang
    f = distributed(gpus=2, hang_timeout=3, max_restarts=1, timeout=90)(_hangs_in)
    with pytest.raises(HangError) as info:
        f.distributed("0,1")                 # attempt 1 hangs too: the watchdog watches it
    err = info.value
    assert err.rank == 1 and "time.sleep(3600)" in err.stacks[1]
    run = RunDir(latest_run_dir(gpulaunch_home))
    assert run.hang().attempt == 1
    assert run.rank_file(1, 1, "stacks").read_text().strip()
    assert_no_survivors(run.path)
