"""Stacks on demand: ``handle.stacks()`` and ``gpulaunch stacks RUN`` on a real running 2-rank
job (real processes, SIGUSR1 -> faulthandler), each request a fresh dump."""

from __future__ import annotations

import time

from conftest import assert_no_survivors

from gpulaunch import cli, distributed


def _wait_for(pred, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return False


def _job(flag_dir: str):
    import os
    import time as _t

    from gpulaunch import runtime as rt

    def phase_one_waiting(rank):
        open(os.path.join(flag_dir, f"ready{rank}"), "w").close()
        while not os.path.exists(os.path.join(flag_dir, "go")):
            _t.sleep(0.05)

    def phase_two_waiting(rank):
        open(os.path.join(flag_dir, f"two{rank}"), "w").close()
        while not os.path.exists(os.path.join(flag_dir, "stop")):
            _t.sleep(0.05)

    rank = rt.get_global_rank()
    phase_one_waiting(rank)
    phase_two_waiting(rank)
    return rank


def test_stacks_of_a_running_two_rank_job_are_fresh_each_time(tmp_path, capsys):
    flags = tmp_path / "flags"
    flags.mkdir()
    h = distributed(gpus=2, stream_logs="none")(_job).submit(str(flags))
    try:
        assert _wait_for(lambda: all((flags / f"ready{r}").exists() for r in (0, 1)))
        first = h.stacks()
        assert sorted(first) == [0, 1]
        for r in (0, 1):
            assert "in phase_one_waiting" in first[r], first[r]
            assert "phase_two_waiting" not in first[r]
            assert "_t.sleep(0.05)" in first[r]           # the source line under the frame
        report = str(first)
        assert "--- rank 0 ---" in report and "--- rank 1 ---" in report  # HangError layout

        (flags / "go").touch()
        assert _wait_for(lambda: all((flags / f"two{r}").exists() for r in (0, 1)))
        second = h.stacks()
        for r in (0, 1):   # only the new dump: the first one's frames are not repeated
            assert "in phase_two_waiting" in second[r], second[r]
            assert "phase_one_waiting" not in second[r], second[r]

        assert cli.main(["stacks", h.run_id]) == 0      # the CLI, on the same run
        out = capsys.readouterr().out
        assert "--- rank 1 ---" in out and "in phase_two_waiting" in out
    finally:
        (flags / "stop").touch()
    assert h.result(timeout=60) == [0, 1]             # SIGUSR1 did not disturb the ranks
    assert_no_survivors(h.run_dir)


def test_stacks_of_an_ended_run_say_why_and_the_cli_refuses(tmp_path, capsys):
    flags = tmp_path / "flags"
    flags.mkdir()
    for name in ("go", "stop"):
        (flags / name).touch()
    h = distributed(gpus=2, stream_logs="none")(_job).submit(str(flags))
    assert h.result(timeout=60) == [0, 1]
    stacks = h.stacks()
    assert stacks == {r: "(already finished: its function had returned)" for r in (0, 1)}
    assert cli.main(["stacks", h.run_id]) == 2
    assert "is over" in capsys.readouterr().err
