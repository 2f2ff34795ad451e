"""Multi-node on Ray (issue 6), on a real local Ray cluster of 3 simulated nodes x 2 CPU slots.

Every run is real: Ray actors in a placement group, one torchelastic agent per node, gloo
collectives between "nodes". The cluster is started once for the module (Ray start costs
several seconds and ~1 GB); tests that damage it (removing a node) come last and repair it.
Bounds on time (BOUND_S) only catch hangs; nothing here asserts speed.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

ray = pytest.importorskip("ray")

from conftest import alive  # noqa: E402
from ray_sim import simulated_cluster  # noqa: E402

from gpulaunch import NodeLostError, RayCluster, distributed  # noqa: E402
from gpulaunch import runtime as rt
from gpulaunch.backends.ray.ray_launch import ray_launch  # noqa: E402
from gpulaunch.common.rundir import RunDir, read_json  # noqa: E402
from gpulaunch.errors import (  # noqa: E402
    ConfigurationError,
    GPUTypeError,
    GPUValidationError,
    HangError,
    LaunchError,
    RunCancelledError,
)

BOUND_S = 120.0
NODES, SLOTS = 3, 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with simulated_cluster(tmp_path_factory.mktemp("ray"), NODES, SLOTS, "r") as c:
        yield c


@pytest.fixture(autouse=True)
def no_run_outlives_its_test(request):
    """A run a test leaves going (a failed assertion before its cancel) would hold the
    cluster's slots and fail every later test with "could not reserve": stop it here, and fail
    a test that passed while leaving one behind."""
    from gpulaunch.caller.registry import ACTIVE
    yield
    left = ACTIVE.runs()
    for run in left:
        run.stop("cancelled")
    if left and ray.is_initialized():
        assert_cluster_free()
    report = getattr(request.node, "rep_call", None)
    if left and report is not None and report.passed:
        pytest.fail(f"the test left {len(left)} run(s) going: "
                    f"{[r.run.run_id for r in left if r.run is not None]}")


def _job_pids(run_dir) -> list[int]:
    """Every process the job had on any node: node-agent actors, local agents, ranks."""
    run = RunDir(run_dir)
    pids = set()
    record = run.launch()
    for n in (record.cluster or {}).get("nodes") or []:
        if n.get("actor_pid"):
            pids.add(int(n["actor_pid"]))
    job = run.job()
    for n in job.nodes if job is not None else []:
        if n.agent_pid:
            pids.add(int(n.agent_pid))
        pids.update(int(p) for p in n.pids.values())
    for info in run.attempt_dir(0).glob("rank*.info.json"):
        pid = (read_json(info, {}) or {}).get("pid")
        if pid:
            pids.add(int(pid))
    return sorted(pids)


def assert_job_gone(run_dir, expect_at_least: int, wait: float = 30.0) -> None:
    pids = _job_pids(run_dir)
    assert len(pids) >= expect_at_least, f"the run recorded only {pids}"
    deadline = time.monotonic() + wait
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(pids), f"processes of the job survived: {alive(pids)}"


def assert_cluster_free(wait: float = 30.0) -> None:
    """Nothing of ours is still reserved (Ray frees a removed placement group asynchronously)."""
    deadline = time.monotonic() + wait
    while ray.available_resources().get("CPU") != NODES * SLOTS and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == NODES * SLOTS, ray.available_resources()


def _six_ranks(offset: int):
    import os

    import torch
    import torch.distributed as dist
    rt.init()
    t = torch.tensor([float(rt.get_global_rank() + 1)])
    dist.all_reduce(t)                       # gloo, across the simulated nodes
    env = {k: int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
                                            "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    print(f"rank {env['RANK']} on node {env['NODE_RANK']}", flush=True)
    import psutil
    me = psutil.Process(os.getpid())
    listening = {c.laddr.ip for p in (me, me.parent()) for c in p.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN}
    dist.barrier()
    run_dir = os.environ["GPULAUNCH_RUN_DIR"]
    return {"rank": rt.get_global_rank() + offset, "sum": t.item(), "env": env,
            "master": os.environ["MASTER_ADDR"], "listening": sorted(listening),
            "run_dir": run_dir, "mode": oct(os.stat(run_dir).st_mode & 0o777)}


def test_six_ranks_on_three_nodes_results_node_ranks_and_allreduce(cluster, capfd):
    results = distributed(gpus=6, remote=True)(_six_ranks).distributed(0)
    assert [r["rank"] for r in results] == list(range(6))
    assert all(r["sum"] == 21.0 for r in results)                  # 1 + 2 + ... + 6
    for r in results:
        env = r["env"]
        assert env["NODE_RANK"] == env["GROUP_RANK"] == env["RANK"] // SLOTS
        assert env["LOCAL_RANK"] == env["RANK"] % SLOTS
        assert env["WORLD_SIZE"] == 6 and env["LOCAL_WORLD_SIZE"] == SLOTS
    # rendezvous on node 0's cluster address, not loopback
    master = results[0]["master"]
    assert master != "127.0.0.1" and len({r["master"] for r in results}) == 1
    # nothing of the job (agents, ranks) listens on all interfaces or on another host's
    # address: off loopback, only on the node's IP. (A loopback listener is reachable from this
    # host alone; one was seen on every node in a CI run at load 5, its owner not pinned down:
    # torch's free-port probe, for one, binds and listens on localhost.)
    assert master in results[0]["listening"], "node 0's agent store must have been seen listening"
    off_loopback = [sorted(set(r["listening"]) - {"127.0.0.1", "::1"}) for r in results]
    assert all(ips in ([master], []) for ips in off_loopback), [r["listening"] for r in results]
    # each node's ranks ran from a private run directory of that node, not the caller's
    assert len({r["run_dir"] for r in results}) == NODES
    assert all(r["mode"] == "0o700" for r in results)
    out = capfd.readouterr().out
    for rank in range(6):
        assert f"[node {rank // SLOTS} rank {rank}] rank {rank} on node {rank // SLOTS}" in out


def _raise_on_rank_4():
    import torch
    import torch.distributed as dist
    rt.init()
    t = torch.ones(1)
    dist.all_reduce(t)
    if rt.get_global_rank() == 4:
        raise KeyError("rank four is unhappy")
    dist.all_reduce(t)                       # the others wait here until torn down
    return 0


def test_exception_on_rank_4_keeps_type_traceback_rank_and_node(cluster, gpulaunch_home):
    fn = distributed(gpus=6, cluster=RayCluster(), stream_logs="none")(_raise_on_rank_4)
    start = time.monotonic()
    with pytest.raises(KeyError) as info:
        fn.distributed()
    assert time.monotonic() - start < BOUND_S
    exc = info.value
    assert exc.rank == 4 and exc.node_rank == 2
    assert "node 2 @" in exc.host
    cause = str(exc.__cause__)
    assert 'raise KeyError("rank four is unhappy")' in cause and "rank 4" in cause
    assert "_raise_on_rank_4" in exc.remote_traceback
    run_dir = exc.run_dir
    assert_job_gone(run_dir, expect_at_least=6 + 2 * NODES)


def _rank_3_skips_the_collective():
    import time

    import torch
    import torch.distributed as dist
    rt.init()
    t = torch.ones(1)
    if rt.get_global_rank() == 3:
        time.sleep(3600)                      # on node 1: never joins the all_reduce
    dist.all_reduce(t)                        # everyone else waits here, on both nodes
    return t.item()


@pytest.mark.slow
def test_hang_on_one_node_is_reported_with_stacks_and_stops_every_node(cluster):
    fn = distributed(gpus=4, remote=True, hang_timeout=8, stream_logs="none")(
        _rank_3_skips_the_collective)
    start = time.monotonic()
    with pytest.raises(HangError) as info:
        fn.distributed()
    assert time.monotonic() - start < BOUND_S
    err = info.value
    assert "made no progress for" in str(err)
    assert 3 in err.stacks and "time.sleep(3600)" in err.stacks[3]
    waiting = [r for r in err.stacks if r != 3]
    assert waiting and all("dist.all_reduce(t)" in err.stacks[r] for r in waiting), err.stacks
    assert_job_gone(err.run_dir, expect_at_least=4 + 2 * 2)
    assert_cluster_free()


def test_job_the_cluster_can_never_hold_fails_at_once_naming_what_is_missing(cluster):
    start = time.monotonic()
    with pytest.raises(GPUValidationError) as info:
        distributed(gpus=8, remote=True)(_six_ranks).distributed(0)
    assert time.monotonic() - start < 10       # never waits on an infeasible placement
    msg = str(info.value)
    assert "gpus=8" in msg and "4 node(s) with 2 CPU slot(s)" in msg
    assert "Missing: 1 node(s)" in msg and "gpus<=6" in msg
    with pytest.raises(GPUValidationError, match="does not divide"):
        distributed(gpus=5, remote=True)(_six_ranks).distributed(0)
    with pytest.raises(GPUTypeError, match="no GPU"):
        distributed(gpus=2, gpu_type="H100", remote=True)(_six_ranks).distributed(0)
    # nothing was left reserved: the whole cluster is free again
    assert_cluster_free()


def _sleep_forever():
    import time

    import torch
    import torch.distributed as dist
    rt.init()
    dist.all_reduce(torch.ones(1))
    print("READY", flush=True)
    time.sleep(600)


def _wait_ready(handle, ranks: int) -> None:
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        if handle.logs().count("READY") >= ranks:
            return
        assert not handle.done(), handle.result()
        time.sleep(0.5)
    text = _where_it_stands(handle)
    handle.cancel()
    raise AssertionError(f"ranks never got ready:\n{text}")


def _where_it_stands(handle) -> str:
    """Everything that says where a stuck multi-node job is: the caller's status, and each
    simulated node's status, agent output, rank logs and (after SIGUSR1) rank stacks."""
    import glob
    run = RunDir(handle.run_dir)
    out = [f"caller job: {run.job()}", f"caller logs:\n{handle.logs()}"]
    nodes_home = os.path.join(os.environ["GPULAUNCH_HOME"], "ray-nodes")
    node_dirs = sorted(glob.glob(os.path.join(nodes_home, "*", "runs", run.run_id)))
    for d in node_dirs:
        for info in glob.glob(os.path.join(d, "attempt*", "rank*.info.json")):
            pid = (read_json(info, {}) or {}).get("pid")
            if pid:
                try:
                    os.kill(int(pid), signal.SIGUSR1)    # the worker dumps every thread's stack
                except ProcessLookupError:
                    pass
    time.sleep(1.0)
    for d in node_dirs:
        out.append(f"--- node dir {d}: {sorted(os.listdir(d))}")
        for name in sorted(glob.glob(os.path.join(d, "status*.json")) +
                           glob.glob(os.path.join(d, "agent.log")) +
                           glob.glob(os.path.join(d, "attempt*", "rank*"))):
            if name.endswith((".json", ".log", ".stacks")):
                try:
                    out.append(f"{name}:\n{open(name, errors='replace').read()[-3000:]}")
                except OSError as e:
                    out.append(f"{name}: {e}")
    return "\n".join(out)


def test_submit_then_cancel_stops_every_node(cluster):
    handle = distributed(gpus=4, remote=True)(_sleep_forever).submit()
    assert handle.status == "RUNNING"
    _wait_ready(handle, 4)
    handle.cancel()
    assert handle.status == "CANCELLED"
    with pytest.raises(RunCancelledError):
        handle.result(timeout=BOUND_S)
    assert_job_gone(handle.run_dir, expect_at_least=4 + 2 * 2)
    assert_cluster_free()


def test_killing_one_nodes_agent_tears_down_the_job(cluster):
    handle = distributed(gpus=6, remote=True)(_sleep_forever).submit()
    _wait_ready(handle, 6)
    nodes = RunDir(handle.run_dir).launch().cluster["nodes"]
    victim = nodes[1]["actor_pid"]
    os.kill(victim, signal.SIGKILL)               # node 1's agent dies as with its machine
    start = time.monotonic()
    with pytest.raises(NodeLostError) as info:
        handle.result(timeout=BOUND_S)
    assert time.monotonic() - start < BOUND_S
    assert info.value.node_rank == 1
    assert "Node 1" in str(info.value) and "ranks 2-3" in str(info.value)
    assert_job_gone(handle.run_dir, expect_at_least=6 + 2 * NODES)
    assert_cluster_free()


@pytest.mark.parametrize("call", ["submit", "distributed"])
def test_losing_the_callers_run_directory_stops_the_job_with_an_error(cluster, gpulaunch_home,
                                                                       call):
    """If following a run fails in the caller (here: its run directory is deleted while the
    ranks run), the handle must not report RUNNING forever with the job still holding the
    cluster, nor .distributed() hang: the ranks are stopped and the caller is told."""
    import shutil
    import threading
    fn = distributed(gpus=4, remote=True, stream_logs="none")(_sleep_forever)
    seen = {}

    def delete_once_ready(run_dir_of):
        deadline = time.monotonic() + BOUND_S
        while time.monotonic() < deadline:
            run_dir = run_dir_of()
            logs = run_dir and RunDir(run_dir).attempt_dir(0).glob("rank*.log")
            if logs and sum(p.read_text().count("READY") for p in logs) >= 4:
                seen["pids"] = _job_pids(run_dir)
                shutil.rmtree(run_dir)
                return
            time.sleep(0.3)

    if call == "submit":
        handle = fn.submit()
        delete_once_ready(lambda: handle.run_dir)
        with pytest.raises(LaunchError, match="lost track of run") as info:
            handle.result(timeout=BOUND_S)
        assert handle.done()
    else:
        def newest():
            runs = sorted((gpulaunch_home / "runs").glob("*"), key=lambda p: p.stat().st_mtime)
            return str(runs[-1]) if runs else None
        threading.Thread(target=delete_once_ready, args=(newest,), daemon=True).start()
        with pytest.raises(LaunchError, match="lost track of run") as info:
            fn.distributed()
    assert isinstance(info.value.__cause__, OSError)
    pids = seen["pids"]
    assert len(pids) >= 4 + 2 * 2
    deadline = time.monotonic() + 30
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(pids), f"processes of the job survived: {alive(pids)}"
    assert_cluster_free()


# A driver script (argv[1]: the cluster address) whose 4 ranks on the cluster sleep once ready;
# each test appends what the driver does next.
READY_DRIVER = '''
import sys, time
import ray
from gpulaunch import distributed, runtime as rt
from gpulaunch.caller.registry import ACTIVE

def sleeper():
    import time, torch, torch.distributed as dist
    rt.init()
    dist.all_reduce(torch.ones(1))
    print("READY", flush=True)
    time.sleep(600)

h = distributed(gpus=4, cluster=sys.argv[1])(sleeper).submit()
print("RUN_DIR", h.run_dir, flush=True)
while h.logs().count("READY") < 4:
    time.sleep(0.5)
'''

DISCONNECTING_DRIVER = READY_DRIVER + '''
ray.shutdown()                      # e.g. a notebook cell that tidies up Ray mid-run
try:
    h.result(timeout=60)
except Exception as e:
    print("RAISED", type(e).__name__, str(e).splitlines()[0], flush=True)
print("CONNECTED_AGAIN", ray.is_initialized(), "STILL_ACTIVE", len(ACTIVE.runs()), flush=True)
'''


@pytest.mark.slow
def test_ray_shutdown_mid_run_ends_the_run_without_reconnecting(cluster, tmp_path):
    """ray.shutdown() in the caller while a job runs: the job ends (Ray stops the actors this
    driver owned, and with them the ranks), result() says why, and gpulaunch never silently
    opens a new Ray connection to poll a job that is gone."""
    import subprocess
    import sys

    from conftest import python_env
    script = tmp_path / "driver.py"
    script.write_text(DISCONNECTING_DRIVER)
    out = subprocess.run([sys.executable, str(script), cluster.address], env=python_env(),
                         capture_output=True, text=True, timeout=BOUND_S * 2)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "RAISED LaunchError The connection to the Ray cluster ended" in out.stdout, \
        out.stdout[-3000:] + out.stderr[-3000:]
    assert "CONNECTED_AGAIN False STILL_ACTIVE 0" in out.stdout
    run_dir = next(line.split(None, 1)[1].strip() for line in out.stdout.splitlines()
                   if line.startswith("RUN_DIR"))
    assert_job_gone(run_dir, expect_at_least=4 + 2 * 2)
    assert_cluster_free(60)


def _ddp_loss(steps: int = 30) -> float:
    import torch
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    device = rt.init()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1)).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rt.get_global_rank())
    w = torch.linspace(-1, 1, 10)
    for _ in range(steps):
        x = torch.randn(32, 10, generator=gen)
        loss = nn.functional.mse_loss(model(x).squeeze(-1), x @ w)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


@pytest.mark.slow
def test_ddp_on_two_nodes_matches_one_host_with_the_same_world_size(cluster):
    # bounded, so that a stall fails in a minute with every rank's stack (HangError), not
    # silently at pytest's timeout
    bounds = dict(stream_logs="none", timeout=BOUND_S, hang_timeout=60)
    two_nodes = distributed(gpus=4, remote=True, **bounds)(_ddp_loss).distributed()
    one_host = distributed(gpus=4, **bounds)(_ddp_loss).distributed()
    assert two_nodes == pytest.approx(one_host, rel=1e-6, abs=1e-7)


@pytest.mark.slow
def test_mlp_ddp_recipe_on_two_nodes_matches_one_host(cluster, tmp_path):
    """The recipes' DDP script, unchanged but for --cluster: 2 nodes x 2 ranks vs 4 ranks here."""
    import json
    import subprocess
    import sys

    from conftest import ROOT, python_env
    results, printed = {}, {}
    for where, extra in (("ray", ["--cluster", cluster.address]), ("local", [])):
        out = tmp_path / f"{where}.json"
        proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "pytorch_mlp_ddp.py"), "--gpus", "4",
                               "--epochs", "1", "--out", str(out), *extra], cwd=str(tmp_path), env=python_env(),
                              capture_output=True, text=True, timeout=BOUND_S * 3)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        results[where] = json.loads(out.read_text())
        printed[where] = proc.stdout
    assert "[node 0 rank 0]" in printed["ray"] and "[node " not in printed["local"]  # it ran on Ray nodes
    assert results["ray"]["world_size"] == results["local"]["world_size"] == 4
    assert results["ray"]["after"] < results["ray"]["before"]          # it trained
    assert results["ray"]["after"] == pytest.approx(results["local"]["after"], rel=1e-6)


def _ray_program():
    import os
    import tempfile
    import time

    import ray
    gate = tempfile.mkdtemp(prefix="gl-gate-")      # the simulated nodes share this disk

    @ray.remote(num_cpus=SLOTS)
    def where(i):
        # hold the bundle until every task has one: a task that ended early would free its
        # bundle for the next task, and two would then report the same node (a CI flake)
        open(os.path.join(gate, str(i)), "w").close()
        deadline = time.monotonic() + 120
        while len(os.listdir(gate)) < NODES and time.monotonic() < deadline:
            time.sleep(0.05)
        return ray.get_runtime_context().get_node_id()

    # three tasks that each need a whole bundle, all at once: they land on the three nodes
    nodes = ray.get([where.remote(i) for i in range(NODES)])
    return len(set(nodes))


def test_ray_launch_runs_once_with_the_allocation_as_its_cluster(cluster):
    fn = ray_launch(gpus=6, remote=True)(_ray_program)
    assert fn.distributed() == [NODES] + [None] * 5

    def boom():
        raise ValueError("driver failed")
    with pytest.raises(ValueError, match="driver failed") as info:
        ray_launch(gpus=2, remote=True)(boom).distributed()
    assert "Traceback from the ray_launch driver" in str(info.value.__cause__)
    assert_cluster_free()


# ----------------------------------------------------------------- layout (pure functions)
from gpulaunch.backends.ray.placement import NodeView, plan  # noqa: E402
from gpulaunch.compute import GPUType  # noqa: E402


def _gpu_nodes(n, gpus=8, kind="H100"):
    return [NodeView(f"id{i}", f"10.0.0.{i}", cpus=96, gpus=gpus, gpu_types=(kind,))
            for i in range(n)]


def _log_from_each_node(fail: bool):
    import os

    import mlflow
    import torch
    import torch.distributed as dist
    rt.init()
    t = torch.ones(1)
    dist.all_reduce(t)
    if int(os.environ["LOCAL_RANK"]) == 0:      # one writer per node, into the caller's run
        mlflow.log_metric(f"seen_by_node_{os.environ['NODE_RANK']}", t.item())
    print(f"rank {rt.get_global_rank()} run {os.environ.get('MLFLOW_RUN_ID')}", flush=True)
    if fail and rt.get_global_rank() == 3:
        raise KeyError("missing on node 1")
    return rt.get_global_rank()


@pytest.mark.slow
def test_tracked_remote_run_is_one_mlflow_run_written_by_every_node(cluster, tmp_path,
                                                                       monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from gpulaunch.tracking import caller as tracking_caller
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("GPULAUNCH_TRACKING", "1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "ray")
    monkeypatch.setenv("GPULAUNCH_SYSTEM_METRICS_INTERVAL", "1")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    tracking_caller._warned.clear()
    fn = distributed(gpus=4, remote=True, timeout=BOUND_S)(_log_from_each_node)

    handle = fn.submit(False)
    assert handle.result(timeout=BOUND_S) == [0, 1, 2, 3]
    import gpulaunch.tracking
    assert gpulaunch.tracking.flush(timeout=120)   # a call's MLflow run ends in the background
    client = MlflowClient(uri)
    run = client.get_run(handle.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["seen_by_node_0"] == run.data.metrics["seen_by_node_1"] == 4.0
    assert run.data.params["gpulaunch.nnodes"] == "2"
    # each node's agent sampled its own node into the same run
    for node in (0, 1):
        assert f"system/node_{node}/cpu_utilization_percentage" in run.data.metrics
    logged = {f.path for f in client.list_artifacts(run.info.run_id, "logs/attempt0")}
    assert {f"logs/attempt0/rank{r}.log" for r in range(4)} <= logged
    text = open(client.download_artifacts(run.info.run_id, "logs/attempt0/rank3.log")).read()
    assert f"rank 3 run {run.info.run_id}" in text

    # A failing rank on node 1: the run is FAILED and carries the same error the caller gets.
    handle = fn.submit(True)
    with pytest.raises(KeyError, match="missing on node 1"):
        handle.result(timeout=BOUND_S)
    assert gpulaunch.tracking.flush(timeout=120)
    run = client.get_run(handle.mlflow_run_id)
    assert run.info.status == "FAILED"
    report = open(client.download_artifacts(run.info.run_id, "gpulaunch/error.txt")).read()
    assert "missing on node 1" in report and "rank 3" in report
    assert_cluster_free()


def test_layout_takes_every_gpu_of_a_node_and_the_accelerator_resource():
    lay = plan(_gpu_nodes(2), gpus=16, gpu_type=GPUType.H100, gpus_per_node=None,
               force_cpu=False)
    assert (lay.device, lay.nnodes, lay.nproc_per_node) == ("cuda", 2, 8)
    assert lay.bundle == {"GPU": 8, "accelerator_type:H100": 0.001}
    assert lay.actor_options() == {"num_cpus": 0, "num_gpus": 8,
                                   "resources": {"accelerator_type:H100": 0.001}}
    small = plan(_gpu_nodes(2), gpus=4, gpu_type=None, gpus_per_node=None, force_cpu=False)
    assert (small.nnodes, small.nproc_per_node) == (1, 4)
    four = plan(_gpu_nodes(4), gpus=16, gpu_type=None, gpus_per_node=4, force_cpu=False)
    assert (four.nnodes, four.nproc_per_node) == (4, 4)


def test_which_mlflow_stores_other_nodes_cannot_reach_without_shared_storage():
    from gpulaunch.tracking.callback import is_local_store as _is_local_store
    for uri in ("sqlite:////home/me/.gpulaunch/mlflow.db", "file:///tmp/mlruns", "/tmp/mlruns",
                "./mlruns", "mlruns"):
        assert _is_local_store(uri), uri
    for uri in ("http://mlflow:5000", "https://x.example/mlflow", "databricks",
                "databricks://profile", "postgresql://db/mlflow"):
        assert not _is_local_store(uri), uri


def test_layout_refusals_name_the_gap():
    with pytest.raises(GPUValidationError, match="Missing: 1 node"):
        plan(_gpu_nodes(2), gpus=24, gpu_type=None, gpus_per_node=None, force_cpu=False)
    with pytest.raises(GPUValidationError, match="does not divide"):
        plan(_gpu_nodes(2), gpus=12, gpu_type=None, gpus_per_node=None, force_cpu=False)
    with pytest.raises(GPUTypeError, match="no node of the Ray cluster has it"):
        plan(_gpu_nodes(2, kind="A10G"), gpus=8, gpu_type=GPUType.H100, gpus_per_node=None,
             force_cpu=False)
    # a cluster that grows on demand: no static refusal, the placement group waits instead
    lay = plan(_gpu_nodes(1), gpus=32, gpu_type=None, gpus_per_node=8, autoscaling=True,
               force_cpu=False)
    assert lay.nnodes == 4
    mixed = _gpu_nodes(1, kind="A10G") + _gpu_nodes(2, kind="H100")
    typed = plan(mixed, gpus=16, gpu_type=GPUType.H100, gpus_per_node=None, force_cpu=False)
    assert typed.accel_resource == "accelerator_type:H100" and typed.nnodes == 2


def test_cluster_settings_are_checked_at_decoration_time():
    with pytest.raises(ConfigurationError, match="gpus_per_node"):
        distributed(gpus=4, cluster=RayCluster(gpus_per_node=0))
    with pytest.raises(ConfigurationError, match="cluster="):
        distributed(gpus=4, cluster=42)(_six_ranks)
    fn = distributed(gpus=4, cluster="ray://head:10001")(_six_ranks)
    assert fn._spec_here().remote is True


# ----------------------------------------------------------------- environment shipping
DRIVER = '''
import sys
from gpulaunch import RayCluster, distributed

@distributed(gpus=4, cluster=RayCluster(address=sys.argv[1], runtime_env={
    "working_dir": sys.argv[2], "env_vars": {"SHIPPED_SETTING": "from-runtime-env"}}))
def uses_shipped_code():
    import os
    import shipped_helper            # exists only in the working_dir, not in the caller's path
    return shipped_helper.VALUE, os.environ.get("SHIPPED_SETTING")

print("RESULT", uses_shipped_code.distributed())
'''


@pytest.mark.slow
def test_second_driver_ships_its_working_dir_and_env_vars_through_ray(cluster, tmp_path):
    import subprocess
    import sys

    from conftest import python_env
    code = tmp_path / "project"
    code.mkdir()
    (code / "shipped_helper.py").write_text("VALUE = 'shipped'\n")
    driver = tmp_path / "elsewhere"
    driver.mkdir()
    (driver / "driver.py").write_text(DRIVER)
    out = subprocess.run([sys.executable, str(driver / "driver.py"), cluster.address, str(code)],
                         cwd=str(driver), env=python_env(), capture_output=True, text=True,
                         timeout=BOUND_S * 2)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "RESULT [('shipped', 'from-runtime-env')" in out.stdout
    assert out.stdout.count("'shipped'") == 4


KILLED_DRIVER = READY_DRIVER + '''
print("ALL_READY", flush=True)
time.sleep(600)
'''


@pytest.mark.slow
def test_killed_caller_leaves_nothing_on_any_node(cluster, tmp_path):
    import subprocess
    import sys

    from conftest import python_env
    script = tmp_path / "driver.py"
    script.write_text(KILLED_DRIVER)
    proc = subprocess.Popen([sys.executable, str(script), cluster.address], env=python_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_dir, lines = None, []
    deadline = time.monotonic() + BOUND_S * 2
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("RUN_DIR"):
                run_dir = line.split(None, 1)[1].strip()
            if line.startswith("ALL_READY") or time.monotonic() > deadline:
                break
        assert run_dir and lines[-1].startswith("ALL_READY"), "".join(lines[-50:])
        pids = _job_pids(run_dir)
        os.kill(proc.pid, signal.SIGKILL)          # the notebook kernel dies outright
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(pids) >= 4 + 2 * 2
    end = time.monotonic() + 60
    while alive(pids) and time.monotonic() < end:
        time.sleep(0.5)
    assert not alive(pids), f"processes of the job survived the caller: {alive(pids)}"
    assert_cluster_free(60)


# ----------------------------------------------------------------- last: it damages the cluster
@pytest.mark.slow
def test_losing_a_whole_node_mid_run_tears_down_the_job(cluster):
    handle = distributed(gpus=6, remote=True, stream_logs="none")(_sleep_forever).submit()
    _wait_ready(handle, 6)
    status = {"nodes": RunDir(handle.run_dir).launch().cluster["nodes"]}
    node_id = status["nodes"][2]["node_id"]
    victim = next(n for n in cluster.worker_nodes if n.node_id == node_id) \
        if any(n.node_id == node_id for n in cluster.worker_nodes) else None
    if victim is None:        # node 2 landed on the head: take a worker node's index instead
        idx = next(i for i, n in enumerate(status["nodes"])
                   if any(w.node_id == n["node_id"] for w in cluster.worker_nodes))
        node_id = status["nodes"][idx]["node_id"]
        victim = next(n for n in cluster.worker_nodes if n.node_id == node_id)
    else:
        idx = 2
    cluster.remove_node(victim, allow_graceful=False)      # the machine is gone
    try:
        with pytest.raises(NodeLostError) as info:
            handle.result(timeout=BOUND_S)
        assert info.value.node_rank == idx
        assert_job_gone(handle.run_dir, expect_at_least=6 + 2 * NODES, wait=60)
    finally:
        cluster.add_node(num_cpus=SLOTS)
        cluster.wait_for_nodes()
