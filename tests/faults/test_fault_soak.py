"""A short, seeded run of bench/fault_soak.py: warm and cold calls with random faults (every
fault kind on both a warm pool and a cold call) leave no process, no hang and nothing readable
by group or others, and each call's outcome is its expected error type."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, python_env

sys.path.insert(0, str(ROOT / "bench"))
import fault_soak  # noqa: E402  (bench/fault_soak.py)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_seeded_fault_soak_leaves_nothing_behind(tmp_path):
    out = tmp_path / "soak.json"
    env = python_env({"GPULAUNCH_TRACKING": "1"})
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "fault_soak.py"), "--calls", "20", "--seed", "3",
         "--tracking", "--home", str(tmp_path / "home"), "--out", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=540, env=env)
    assert out.exists(), proc.stderr[-3000:]
    soak = json.loads(out.read_text())
    assert soak["calls"] == 20 and all(soak["by_kind"].values()), soak["by_kind"]
    assert soak["warm_calls_served_by_a_live_pool"] > 0
    assert soak["wrong"] == [], soak["wrong"]                   # the expected error type each
    assert soak["hangs"] == []                                  # each within its bound
    assert soak["left_after_call"] == [] and soak["left_at_end"] == []
    assert soak["children_at_end"] == [] and soak["strays_at_end"] == []
    assert soak["readable_by_others"] == []
    assert proc.returncode == 0 and soak["clean"], proc.stderr[-3000:]


def test_the_soaks_checks_see_a_survivor_and_a_readable_file(tmp_path):
    """What the soak counts as left behind: a process whose environment names its home, a
    file with group or other bits."""
    home = str(tmp_path)
    child = subprocess.Popen([sys.executable, "-c", "import time; print(1, flush=True); "
                              "time.sleep(60)"], env=dict(os.environ, GPULAUNCH_HOME=home),
                             stdout=subprocess.PIPE)
    try:
        child.stdout.readline()     # running: its environment is readable (not mid-exec)
        assert fault_soak.survivors({child.pid}, home, wait=0.5) == [child.pid]
        assert fault_soak.survivors({child.pid}, home + "-other", wait=0) == []
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    assert fault_soak.survivors({child.pid}, home, wait=0) == []
    secret = tmp_path / "runs" / "r1" / "rank0.locals.json"
    secret.parent.mkdir(parents=True, mode=0o700)
    os.chmod(secret.parent.parent, 0o700)
    secret.write_text("{}")
    os.chmod(secret, 0o644)
    assert fault_soak.readable_by_others(home) == ["0o644 runs/r1/rank0.locals.json"]
