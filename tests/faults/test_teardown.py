"""Bounded teardown (issue 17): once a rank has written its result, a teardown that hangs (an
atexit handler, a tracker flushing to a dead server) is cut after GPULAUNCH_TEARDOWN_TIMEOUT
seconds and the caller gets its results, not the 3-hour timeout. Real ranks, a real hang."""

from __future__ import annotations

import pytest
from conftest import assert_no_survivors, latest_run_dir

from gpulaunch import distributed
from gpulaunch.common.rundir import RunDir

pytestmark = pytest.mark.slow


def _result_then_stuck_atexit():
    import atexit
    import os
    import time
    atexit.register(time.sleep, 3600)        # a teardown that never ends on its own
    return int(os.environ["RANK"])


def test_a_hanging_teardown_is_cut_and_the_results_come_back(gpulaunch_home, monkeypatch):
    monkeypatch.setenv("GPULAUNCH_TEARDOWN_TIMEOUT", "2")
    # timeout=: without the bound, this would end as a RunTimeoutError after 60 s
    out = distributed(gpus=2, timeout=60)(_result_then_stuck_atexit).distributed()
    assert out == [0, 1]
    run = RunDir(latest_run_dir(gpulaunch_home))
    log = run.rank_file(0, 0, "log").read_text()
    assert "GPULAUNCH_TEARDOWN_TIMEOUT" in log and "took over 2 s" in log
    assert_no_survivors(run.path)
