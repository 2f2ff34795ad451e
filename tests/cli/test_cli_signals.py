"""A SIGTERM or SIGHUP to ``gpulaunch run`` (Slurm's scancel or time limit, ``kill``, a closed
terminal) does what torchrun does: every rank is stopped, the agent records the stop, and only
then does the launcher exit 128 + the signal. A cluster SIGKILLs whatever is left of a step
once its first process exited, so a run that is not over when the launcher exits is recorded
as running forever."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time

import pytest
from conftest import PY, assert_no_survivors, latest_run_dir, python_env

from gpulaunch.common.rundir import RunDir

SCRIPT = textwrap.dedent("""
    import os, time, torch.distributed as dist
    dist.init_process_group("gloo")
    open(os.path.join(os.environ["READY_DIR"], f"rank{dist.get_rank()}"), "w").close()
    time.sleep(120)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_signal_ends_the_run_before_the_launcher_exits(tmp_path, gpulaunch_home, sig):
    ready = tmp_path / "ready"
    ready.mkdir()
    script = tmp_path / "sleeps.py"
    script.write_text(SCRIPT)
    p = subprocess.Popen([PY, "-m", "gpulaunch", "run", "--nproc-per-node", "2", "--no-tracking",
                          str(script)], env=python_env({"READY_DIR": str(ready)}), cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(list(ready.iterdir())) < 2:
            assert p.poll() is None, p.communicate()[0]
            assert time.monotonic() < deadline, "the ranks never came up"
            time.sleep(0.1)
        p.send_signal(sig)
        out, _ = p.communicate(timeout=90)
        # what slurmstepd does once the step's first process exited: SIGKILL the rest
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 128 + sig, out
    assert f"gpulaunch: got {sig.name}; every rank was stopped" in out, out
    run_dir = latest_run_dir(gpulaunch_home)
    status = RunDir(run_dir).status()
    assert status.state.terminal and status.state != "SUCCEEDED", status
    assert_no_survivors(run_dir)
