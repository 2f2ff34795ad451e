"""``gpulaunch run --nnodes 2``: two real CLI processes on loopback act as two nodes (each starts
its own agent and 2 CPU ranks; gloo across all 4), as torchrun on two machines would."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import textwrap
from pathlib import Path

from conftest import PY, assert_no_survivors, python_env

SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    r = dist.get_rank()
    t = torch.tensor([float(r + 1)])
    dist.all_reduce(t)
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
            "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT")
    out = {k: os.environ.get(k) for k in keys}
    out["sum"] = t.item()
    print(f"rank {r} sum {t.item()}", flush=True)
    name = f"rank{r}.attempt{out['TORCHELASTIC_RESTART_COUNT']}.json"
    with open(os.path.join(sys.argv[1], name), "w") as f:
        json.dump(out, f)
    how = os.environ.get("FAIL_HOW")
    if os.environ.get("FAIL_ONCE") and out["TORCHELASTIC_RESTART_COUNT"] != "0":
        how = None             # the restarted attempt succeeds
    if how and int(os.environ["FAIL_RANK"]) == r:
        if how == "raise":
            raise ValueError(f"boom on rank {r}")
        os.kill(os.getpid(), 9)
    if how:
        time.sleep(120)        # busy elsewhere: only the peer watch can stop this rank
    dist.barrier()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(tmp_path: Path, flags=None, envs=None, extra_env=None, timeout=120):
    """Start node 1 first (it waits for node 0, as on a real cluster), then node 0; return
    [(exit code, stdout+stderr, run dir), ...] by node rank."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    procs = []
    for node in (1, 0):
        home = tmp_path / f"home{node}"
        env = python_env({"GPULAUNCH_HOME": str(home), "GPULAUNCH_QUIET": "", **(extra_env or {}),
                          **((envs or {}).get(node, {}))})
        argv = [PY, "-m", "gpulaunch.cli", "run", "--gpus", "2", "--no-tracking",
                *(flags(node) if flags else []), str(script), str(out)]
        procs.append((node, home, subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                                   stderr=subprocess.STDOUT, text=True)))
    results = {}
    for node, home, p in procs:
        try:
            text, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for _, _, q in procs:
                q.kill()
            raise
        runs = sorted((home / "runs").iterdir()) if (home / "runs").exists() else []
        results[node] = (p.returncode, text, runs[-1] if runs else None)
    return [results[0], results[1]], out


def _flags(port, rdzv_id="t"):
    return lambda node: ["--nnodes", "2", "--node-rank", str(node), "--master-addr",
                         "127.0.0.1", "--master-port", str(port), "--rdzv-id", rdzv_id]


def test_two_nodes_one_job(tmp_path):
    (rc0, text0, run0), (rc1, text1, run1) = _two_nodes(tmp_path, _flags(_free_port()))[0]
    out = tmp_path / "out"
    assert (rc0, rc1) == (0, 0), text0 + text1
    ranks = {r: json.loads((out / f"rank{r}.attempt0.json").read_text()) for r in range(4)}
    for r, env in ranks.items():
        assert env["sum"] == 1 + 2 + 3 + 4                      # one group of 4 over both
        assert env["RANK"] == str(r) and env["WORLD_SIZE"] == "4"
        assert env["LOCAL_RANK"] == str(r % 2) and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["NODE_RANK"] == env["GROUP_RANK"] == str(r // 2)
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0"
    # Each node streams (and keeps logs of) its own ranks, by global rank.
    assert "[rank 0]" not in text1 and "[rank 2]" in text1 and "[rank 3]" in text1
    assert (run1 / "attempt0" / "rank3.log").exists() and (run0 / "attempt0" / "rank0.log").exists()
    assert "node 0 of 2" in text0 and "GLOO_SOCKET_IFNAME=lo" in text0
    assert "2 of the job's 4 CPU worker processes" in text0
    assert_no_survivors(run0)
    assert_no_survivors(run1)


def test_slurm_environment_needs_no_flags(tmp_path):
    """Node 1 reads only Slurm's variables (as under ``srun``); node 0 gets flags naming the
    same job id: both must land in one rendezvous."""
    port = _free_port()
    slurm = {"SLURM_JOB_ID": "777", "SLURM_STEP_ID": "0", "SLURM_NNODES": "2", "SLURM_NODEID":
             "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "127.0.0.[1-2]",
             "MASTER_PORT": str(port)}
    flags = lambda node: [] if node == 1 else _flags(port, "777")(0)  # noqa: E731
    (rc0, text0, _), (rc1, text1, _) = _two_nodes(tmp_path, flags, envs={1: slurm})[0]
    assert (rc0, rc1) == (0, 0), text0 + text1
    assert "from Slurm" in text1 and "rendezvous id '777'" in text1
    sums = {json.loads((tmp_path / "out" / f"rank{r}.attempt0.json").read_text())["sum"] for r in range(4)}
    assert sums == {10.0}


def test_failure_on_node_1_stops_node_0(tmp_path):
    fail = {"FAIL_RANK": "3", "FAIL_HOW": "raise"}
    (rc0, text0, run0), (rc1, text1, run1) = _two_nodes(tmp_path, _flags(_free_port()),
                                                        extra_env=fail)[0]
    # Node 1 reports its rank's exception itself; node 0's ranks (sleeping, not in a
    # collective) were stopped, and it names node 1's root cause, with the same exit code.
    assert rc1 == 1 and "rank 3 raised ValueError: boom on rank 3" in text1, text1
    assert rc0 == 1, text0
    assert "Node 1 of the job failed: rank 3: ValueError: boom on rank 3" in text0, text0
    assert str(run1) in text0                        # where that rank's logs are
    assert_no_survivors(run0)
    assert_no_survivors(run1)


def test_killed_rank_on_node_1_gives_node_0_its_signal_exit_code(tmp_path):
    fail = {"FAIL_RANK": "2", "FAIL_HOW": "kill"}
    (rc0, text0, run0), (rc1, text1, _) = _two_nodes(tmp_path, _flags(_free_port()),
                                                     extra_env=fail)[0]
    assert rc1 == 128 + signal.SIGKILL, text1
    assert rc0 == 128 + signal.SIGKILL, text0
    assert "Node 1 of the job failed: rank 2 was killed by SIGKILL" in text0, text0
    assert_no_survivors(run0)


def test_failure_on_node_0_stops_node_1(tmp_path):
    fail = {"FAIL_RANK": "1", "FAIL_HOW": "raise"}
    (rc0, text0, _), (rc1, text1, run1) = _two_nodes(tmp_path, _flags(_free_port()),
                                                     extra_env=fail)[0]
    assert rc0 == 1 and "rank 1 raised ValueError" in text0, text0
    assert rc1 == 1 and "Node 0 of the job failed: rank 1: ValueError" in text1, text1
    assert_no_survivors(run1)


def test_restart_of_one_node_restarts_the_whole_job(tmp_path):
    """max_restarts=1: rank 3 (node 1) dies in attempt 0; node 0's healthy ranks are restarted
    with it (one rendezvous per attempt), and attempt 1 of all 4 ranks succeeds."""
    fail = {"FAIL_RANK": "3", "FAIL_HOW": "kill", "FAIL_ONCE": "1"}
    port = _free_port()
    flags = lambda node: ["--max-restarts", "1", *_flags(port)(node)]  # noqa: E731
    (rc0, text0, run0), (rc1, text1, run1) = _two_nodes(tmp_path, flags, extra_env=fail)[0]
    assert (rc0, rc1) == (0, 0), text0 + text1
    again = {r: json.loads((tmp_path / "out" / f"rank{r}.attempt1.json").read_text())
             for r in range(4)}
    assert {e["sum"] for e in again.values()} == {10.0}
    assert {e["TORCHELASTIC_RESTART_COUNT"] for e in again.values()} == {"1"}
    assert (run0 / "attempt1" / "rank0.log").exists() and (run1 / "attempt1").exists()
    assert "restarting all ranks" in text0 and "restarting all ranks" in text1


def test_incomplete_multi_node_flags_are_refused_before_anything_starts(tmp_path):
    p = subprocess.run([PY, "-m", "gpulaunch.cli", "run", "--nnodes", "2", "--master-addr",
                        "127.0.0.1", "x.py"], env=python_env({"GPULAUNCH_HOME": str(tmp_path)}),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--nnodes 2 needs --node-rank" in p.stderr
    assert not (tmp_path / "runs").exists()
