"""Restarts of a whole job on Ray (issue 21): ``max_restarts`` with ``remote=True``, on a real
local Ray cluster of 2 simulated nodes x 2 CPU slots (gloo between the "nodes"); and, on the
same cluster, ``gpulaunch run --cluster ADDRESS`` running a script there.

Every attempt is real: the failed attempt's ranks are stopped on every node, fresh node agents
start in the same placement group, a fresh rendezvous forms. Results are compared, exactly,
with an uninterrupted run of the same deterministic CPU computation. Bounds on time only catch
hangs; nothing here asserts speed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray")

from conftest import python_env  # noqa: E402
from ray_sim import simulated_cluster  # noqa: E402

from gpulaunch import NodeLostError, distributed  # noqa: E402
from gpulaunch import runtime as rt  # noqa: E402
from gpulaunch.common.rundir import RunDir  # noqa: E402

BOUND_S = 300.0
NODES, SLOTS = 2, 2
WORLD = NODES * SLOTS


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with simulated_cluster(tmp_path_factory.mktemp("ray"), NODES, SLOTS, "rr") as c:
        yield c


def _cluster_free(wait: float = 60.0) -> bool:
    deadline = time.monotonic() + wait
    while ray.available_resources().get("CPU") != NODES * SLOTS and time.monotonic() < deadline:
        time.sleep(0.2)
    return ray.available_resources().get("CPU") == NODES * SLOTS


def _train(mode: str):
    """A deterministic CPU computation with collectives across both nodes; ``mode`` says how
    attempt 0 (or every attempt) goes wrong."""
    import os
    import time

    import torch
    import torch.distributed as dist
    rt.init()
    k, rank = rt.get_restart_count(), rt.get_global_rank()
    torch.manual_seed(1234)
    w = torch.randn(8, dtype=torch.float64)
    for step in range(6):
        g = torch.arange(8, dtype=torch.float64) * (rank + 1) + step + w
        dist.all_reduce(g)
        w = w - 0.01 * g
        if step == 2:
            if mode == "kill_rank" and k == 0 and rank == 2:        # rank 2 is on node 1
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "kill_agent" and k == 0:
                print(f"READY {rank}", flush=True)
                time.sleep(600)                 # the test kills node 1's agent meanwhile
            if mode in ("fail_always", "fail_then_hold") and rank == 2 and \
                    (k == 0 or mode == "fail_always"):
                raise ValueError(f"boom in attempt {k}")
            if mode == "fail_then_hold" and k == 1:
                print(f"READY {rank}", flush=True)
                time.sleep(600)                 # the test kills node 1's agent meanwhile
    dist.barrier()
    return {"rank": rank, "w": w.tolist(), "restart": k, "world": dist.get_world_size()}


@pytest.fixture(scope="module")
def uninterrupted(cluster):
    results = distributed(gpus=WORLD, remote=True, stream_logs="none")(_train).distributed("ok")
    assert [r["restart"] for r in results] == [0] * WORLD
    return [{k: v for k, v in r.items() if k != "restart"} for r in results]


def _without_restart(results):
    return [{k: v for k, v in r.items() if k != "restart"} for r in results]


def test_sigkilled_rank_on_node_1_restarts_the_whole_job_with_the_same_results(
        cluster, uninterrupted):
    fn = distributed(gpus=WORLD, remote=True, max_restarts=1, stream_logs="none")(_train)
    handle = fn.submit("kill_rank")
    results = handle.result(timeout=BOUND_S)
    assert [r["restart"] for r in results] == [1] * WORLD     # the same on every rank
    assert _without_restart(results) == uninterrupted         # exact: deterministic CPU
    run = RunDir(handle.run_dir)
    assert run.attempts() == [0, 1]
    job = run.job()
    assert job.attempt == 1 and len(job.history) == 1
    assert "rank 2" in job.history[0].cause and "SIGKILL" in job.history[0].cause, job.history
    # attempt 0's logs and attempt 1's results sit where a local run with restarts puts them
    assert not run.rank_file(0, 0, "result.pkl").exists()
    assert all(run.rank_file(1, r, "result.pkl").exists() for r in range(WORLD))
    assert _cluster_free()


def test_killed_node_agent_restarts_the_whole_job_with_the_same_results(cluster, uninterrupted):
    fn = distributed(gpus=WORLD, remote=True, max_restarts=1, stream_logs="none")(_train)
    handle = fn.submit("kill_agent")
    deadline = time.monotonic() + BOUND_S
    while handle.logs().count("READY") < WORLD:
        assert time.monotonic() < deadline, handle.logs()
        assert not handle.done(), handle.result()
        time.sleep(0.5)
    nodes = RunDir(handle.run_dir).launch().cluster["nodes"]
    first_actors = {n["node_rank"]: n["actor_pid"] for n in nodes}
    os.kill(first_actors[1], signal.SIGKILL)     # node 1's agent dies as with its machine
    results = handle.result(timeout=BOUND_S)
    assert [r["restart"] for r in results] == [1] * WORLD
    assert _without_restart(results) == uninterrupted
    run = RunDir(handle.run_dir)
    job = run.job()
    assert job.attempt == 1 and "node 1 lost" in job.history[0].cause, job.history
    # attempt 1 ran on fresh node agents, in the same placement (one per simulated node)
    second = {n["node_rank"]: n for n in run.launch().cluster["nodes"]}
    assert second[1]["actor_pid"] != first_actors[1]
    assert len({n["node_id"] for n in second.values()}) == NODES
    assert _cluster_free()


def test_spent_budget_is_one_error_naming_every_attempts_root_cause(cluster):
    fn = distributed(gpus=WORLD, remote=True, max_restarts=2, stream_logs="none")(_train)
    with pytest.raises(ValueError, match="boom in attempt 2") as info:
        fn.distributed("fail_always")
    exc = info.value
    assert exc.rank == 2 and exc.node_rank == 1
    assert exc.restart_history == ["attempt 0: rank 2: ValueError: boom in attempt 0 (node 1)",
                                   "attempt 1: rank 2: ValueError: boom in attempt 1 (node 1)"]
    cause = str(exc.__cause__)
    assert "attempt 2" in cause                       # where the final error happened
    for k in (0, 1):
        assert f"attempt {k}: rank 2: ValueError: boom in attempt {k}" in cause
    assert RunDir(exc.run_dir).attempts() == [0, 1, 2]
    assert _cluster_free()


def test_lost_node_in_the_last_attempt_names_the_earlier_attempts_too(cluster):
    """A restart that ends in a lost node: NodeLostError, with attempt 0's root cause."""
    fn = distributed(gpus=WORLD, remote=True, max_restarts=1, stream_logs="none")(_train)
    handle = fn.submit("fail_then_hold")
    deadline = time.monotonic() + BOUND_S
    while not (RunDir(handle.run_dir).job() and RunDir(handle.run_dir).job().attempt == 1
               and handle.logs().count("READY") >= WORLD):
        assert time.monotonic() < deadline, handle.logs()
        assert not handle.done(), handle.result()
        time.sleep(0.5)
    node1 = next(n for n in RunDir(handle.run_dir).launch().cluster["nodes"]
                 if n["node_rank"] == 1)
    os.kill(node1["actor_pid"], signal.SIGKILL)
    with pytest.raises(NodeLostError) as info:
        handle.result(timeout=BOUND_S)
    assert info.value.node_rank == 1
    assert info.value.restart_history == [
        "attempt 0: rank 2: ValueError: boom in attempt 0 (node 1)"]
    assert "Earlier attempts" in str(info.value)
    assert _cluster_free()


# ----------------------------------------------------------------- gpulaunch run --cluster
SCRIPT = """
import os, sys
import torch, torch.distributed as dist
from gpulaunch import runtime as rt
import helper
rt.init()
t = torch.tensor([float(rt.get_global_rank() + 1)])
dist.all_reduce(t)
here = os.path.dirname(os.path.abspath(__file__))
print(f"script rank {rt.get_global_rank()} node {os.environ['NODE_RANK']} sum {t.item():g} "
      f"args {sys.argv[1:]} {helper.WORD}", flush=True)
print(f"rank {rt.get_global_rank()} ran from {here}", flush=True)
if "--fail" in sys.argv and rt.get_global_rank() == 3:
    raise SystemExit(3)
"""


def _cli(cluster, *args, cwd):
    env = python_env({"GPULAUNCH_TRACKING": "0"})
    return subprocess.run([sys.executable, "-m", "gpulaunch.cli", "run", "--cluster",
                           cluster.address, "--gpus", str(WORLD), *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=BOUND_S)


@pytest.mark.parametrize("ship", [False, True])
def test_cli_runs_a_script_on_the_ray_cluster_and_exits_with_its_code(cluster, tmp_path, ship):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "train.py").write_text(SCRIPT)
    (proj / "helper.py").write_text(f"WORD = {'shipped' if ship else 'local'!r}\n")
    ship_args = ["--working-dir", str(proj)] if ship else []
    proc = _cli(cluster, *ship_args, str(proj / "train.py"), "a", "b", cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    word = "shipped" if ship else "local"
    for r in range(WORLD):
        assert (f"[node {r // SLOTS} rank {r}] script rank {r} node {r // SLOTS} sum 10 "
                f"args ['a', 'b'] {word}") in proc.stdout, out
    for r in range(WORLD):
        ran_from = proc.stdout.split(f"rank {r} ran from ", 1)[1].split()[0]
        # shipped: Ray's copy of the folder on each node; else the caller's path itself
        assert (ran_from != str(proj)) == ship, (ran_from, str(proj))
    proc = _cli(cluster, *ship_args, str(proj / "train.py"), "--fail", cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out
    assert "Rank 3" in proc.stderr and "sys.exit(3)" in proc.stderr, out
    assert _cluster_free()


def test_cli_cluster_refuses_nnodes_and_a_script_outside_the_working_dir(cluster, tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    other = tmp_path / "other"
    other.mkdir()
    proc = _cli(cluster, "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
                str(tmp_path / "train.py"), cwd=tmp_path)
    assert proc.returncode != 0 and "drop --nnodes" in proc.stderr, proc.stderr
    proc = _cli(cluster, "--working-dir", str(other), str(tmp_path / "train.py"), cwd=tmp_path)
    assert proc.returncode != 0 and "outside --working-dir" in proc.stderr, proc.stderr


# ----------------------------------------------------------------- last: it replaces a node
def test_lost_machine_is_replaced_by_another_node_within_the_placement_wait(cluster,
                                                                            uninterrupted):
    """A whole simulated machine goes (its raylet and every process on it): Ray reschedules
    that node's bundle onto a spare node, and attempt 1 runs there with the same results."""
    fn = distributed(gpus=WORLD, remote=True, max_restarts=1, stream_logs="none")(_train)
    handle = fn.submit("kill_agent")             # attempt 0 holds after step 2
    deadline = time.monotonic() + BOUND_S
    while handle.logs().count("READY") < WORLD:
        assert time.monotonic() < deadline, handle.logs()
        assert not handle.done(), handle.result()
        time.sleep(0.5)
    first = RunDir(handle.run_dir).launch().cluster["nodes"]
    workers = {w.node_id: w for w in cluster.worker_nodes}
    victim = next(n for n in first if n["node_id"] in workers)
    cluster.add_node(num_cpus=SLOTS)             # the spare, then the machine is gone
    cluster.remove_node(workers[victim["node_id"]], allow_graceful=False)
    results = handle.result(timeout=BOUND_S)
    assert [r["restart"] for r in results] == [1] * WORLD
    assert _without_restart(results) == uninterrupted
    run = RunDir(handle.run_dir)
    assert f"node {victim['node_rank']} lost" in run.job().history[0].cause, run.job().history
    second = run.launch().cluster["nodes"]
    assert victim["node_id"] not in {n["node_id"] for n in second}
    assert len({n["node_id"] for n in second}) == NODES
    assert _cluster_free()
