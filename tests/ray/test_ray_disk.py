"""Disk hygiene on Ray (issue 17): each node's run directory goes once its agent stopped and the
caller holds every file; the caller's mirror keeps the run's record. A real local Ray cluster of
two simulated nodes."""

from __future__ import annotations

import json
import os

import pytest

ray = pytest.importorskip("ray")

from ray_sim import simulated_cluster  # noqa: E402

from gpulaunch import distributed  # noqa: E402
from gpulaunch.common.rundir import RunDir  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    base = tmp_path_factory.mktemp("ray2")
    with simulated_cluster(base, 2, 1, "r2"):
        yield base / "nodes-home"


def _where():
    import os
    print("hello from", os.environ["RANK"], flush=True)
    return os.environ["GPULAUNCH_RUN_DIR"]


def _fails_on_rank_1():
    import os
    if os.environ["RANK"] == "1":
        raise KeyError("rank one")
    return 0


def test_node_dirs_removed_when_their_agents_stop(two_nodes, gpulaunch_home):
    node_dirs = distributed(gpus=2, remote=True)(_where).distributed()
    assert len(set(node_dirs)) == 2
    assert not any(os.path.exists(d) for d in node_dirs), node_dirs
    # the caller's mirror still holds the run: logs and results of both nodes
    caller = RunDir(sorted((gpulaunch_home / "runs").iterdir())[-1])
    assert caller.rank_file(0, 1, "result.pkl").exists()
    assert caller.rank_file(0, 1, "log").exists()
    with pytest.raises(KeyError, match="rank one"):          # a failure is still reported
        distributed(gpus=2, remote=True)(_fails_on_rank_1).distributed()
    runs = two_nodes / "ray-nodes"
    assert not [p for p in runs.glob("*/runs/*")], list(runs.glob("*/runs/*"))


PRIVATE = """
import json, os
from gpulaunch.backends.ray.ray_launch import ray_launch

@ray_launch(stream_logs="none")
def where():
    import ray
    return [n["NodeManagerAddress"] for n in ray.nodes()]

print("RESULT", json.dumps(where.distributed()[0]))
"""


def test_a_local_ray_is_private_never_the_one_ray_address_names(tmp_path):
    # RAY_ADDRESS names a cluster (here: nothing listening, as a stale or foreign one would
    # be): cluster="local" / ray_launch without a cluster must start its own (before, ray.init
    # (address=None) attached to it, or failed to)
    import subprocess

    from conftest import PY, python_env
    tmpdir = f"/tmp/r3-{os.getpid()}"
    os.makedirs(tmpdir, exist_ok=True)
    env = python_env({"RAY_ADDRESS": "127.0.0.1:1", "RAY_TMPDIR": tmpdir,
                      "RAY_AUTH_MODE": "disabled", "GPULAUNCH_HOME": str(tmp_path / "h")})
    out = subprocess.run([PY, "-c", PRIVATE], capture_output=True, text=True, timeout=300,
                         env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    assert len(json.loads(line.split(" ", 1)[1])) == 1     # its own one-node instance


INTERRUPTED = """
import json, os, signal, threading, time
import ray
from gpulaunch.backends.ray.ray_launch import ray_launch
from ray.util.placement_group import placement_group, placement_group_table

ray.init(address="local", num_cpus=2, include_dashboard=False)
hog = placement_group([{"CPU": 2}])          # the cluster is busy: the launch has to wait
ray.get(hog.ready())

@ray_launch(gpus=2, cluster="auto", stream_logs="none")
def never():
    return 1

threading.Timer(4.0, os.kill, (os.getpid(), signal.SIGINT)).start()   # Ctrl-C while waiting
try:
    never.distributed()
except KeyboardInterrupt:
    pass
time.sleep(2.0)
left = [t["name"] for t in placement_group_table().values()
        if t["state"] != "REMOVED" and t["name"].startswith("gpulaunch")]
print("LEFT", json.dumps(left))
"""


def test_ctrl_c_while_ray_launch_waits_for_its_allocation_leaks_no_placement_group(tmp_path):
    import subprocess

    from conftest import PY, python_env
    tmpdir = f"/tmp/r4-{os.getpid()}"
    os.makedirs(tmpdir, exist_ok=True)
    env = python_env({"RAY_TMPDIR": tmpdir, "RAY_AUTH_MODE": "disabled",
                      "GPULAUNCH_HOME": str(tmp_path / "h")})
    out = subprocess.run([PY, "-c", INTERRUPTED], capture_output=True, text=True, timeout=300,
                         env=env, cwd=tmp_path)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("LEFT ")]
    assert lines, out.stdout[-3000:] + out.stderr[-3000:]
    assert json.loads(lines[-1].split(" ", 1)[1]) == []
