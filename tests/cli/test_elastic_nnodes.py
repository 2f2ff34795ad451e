"""``gpulaunch run --nnodes 1:2``: an elastic job (torch's dynamic rendezvous) on one host, each
"node" a real ``gpulaunch run`` process. A node is lost (its every process SIGKILLed): the other
goes on at WORLD_SIZE=1 from its checkpoint; a fresh node starts with the same command: the
survivor's ranks restart at WORLD_SIZE=2 and the job finishes on both."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from conftest import PY, assert_no_survivors, python_env

from gpulaunch.caller import cluster_env
from gpulaunch.errors import ConfigurationError

# Each step all-reduces 1 from every rank (the sum is the world size), rank 0 checkpoints the
# step; a restarted rank resumes after the checkpoint. The job ends, on every rank at the same
# step, once the test writes DONE and the world is whole again.
SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import torch, torch.distributed as dist
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = os.path.join(out, "ckpt.json")
    step = json.load(open(ckpt))["step"] + 1 if os.path.exists(ckpt) else 0
    first = step
    while True:
        done = os.path.exists(os.path.join(out, "DONE")) and world == 2
        t = torch.tensor([1.0, float(done)])
        dist.all_reduce(t)
        env = {k: os.environ.get(k) for k in ("GROUP_RANK", "NODE_RANK", "ROLE_WORLD_SIZE",
               "LOCAL_RANK", "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT",
               "TORCHELASTIC_MAX_RESTARTS")}
        line = dict(step=step, world=int(os.environ["WORLD_SIZE"]), sum=t[0].item(),
                    rank=rank, first=first, pid=os.getpid(), env=env)
        print("STEP " + json.dumps(line), flush=True)
        if rank == 0:
            with open(ckpt + ".tmp", "w") as f:
                json.dump({"step": step}, f)
            os.replace(ckpt + ".tmp", ckpt)
        if t[1].item() == world:
            break
        step += 1
        time.sleep(0.2)
    dist.destroy_process_group()
""")

CONF = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One ``gpulaunch run --nnodes 1:2`` process, its output collected in a file."""

    def __init__(self, tmp_path: Path, name: str, port: int, script: Path, out: Path):
        self.home = tmp_path / f"home-{name}"
        self.log = tmp_path / f"{name}.out"
        env = python_env({"GPULAUNCH_HOME": str(self.home), "GPULAUNCH_QUIET": ""})
        argv = [PY, "-m", "gpulaunch.cli", "run", "--nnodes", "1:2", "--nproc-per-node", "1",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", CONF,
                "--max-restarts", "3", "--no-tracking", "--log-dir", str(tmp_path / "logs"),
                str(script), str(out)]
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.log.read_text()

    def steps(self) -> list[dict]:
        return [json.loads(line.split("STEP ", 1)[1]) for line in self.text().splitlines()
                if "STEP {" in line]

    def run_dir(self) -> Path:
        return next((self.home / "runs").iterdir())

    def kill_everything(self) -> None:
        """The node's machine dies: every process of it (launcher, agent, ranks) at once."""
        procs = [psutil.Process(self.proc.pid)]
        procs += procs[0].children(recursive=True)
        for p in procs:
            try:
                p.send_signal(signal.SIGSTOP)
            except psutil.NoSuchProcess:
                pass
        for p in procs:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(10)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _wait(what, cond, nodes, timeout=60.0):   # generous: the CI shares the 2 cores
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}:\n" +
                         "\n".join(f"--- {n.log.name}\n{n.text()}" for n in nodes))


def test_lost_node_then_new_node(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    port = _free_port()
    nodes = []
    try:
        a = Node(tmp_path, "a", port, script, out)       # first: hosts the rendezvous
        nodes.append(a)
        _wait("node a to host the rendezvous", lambda: _listening(port), nodes)
        b = Node(tmp_path, "b", port, script, out)
        nodes.append(b)
        _wait("both nodes at WORLD_SIZE=2", lambda: len(
            [s for s in a.steps() if s["world"] == 2]) >= 3 and any(
            s["world"] == 2 for s in b.steps()), nodes)
        # (a may have started alone at WORLD_SIZE=1 for last_call_timeout, then grown to 2)
        b.kill_everything()
        n_before = len(a.steps())
        before = a.steps()[-1]["step"]
        _wait("node a alone at WORLD_SIZE=1", lambda: len(
            [s for s in a.steps()[n_before:] if s["world"] == 1]) >= 3, nodes)
        alone = [s for s in a.steps()[n_before:] if s["world"] == 1]
        assert alone[0]["first"] >= before - 1, alone[0]    # resumed from the checkpoint
        assert all(s["sum"] == 1.0 for s in alone)

        c = Node(tmp_path, "c", port, script, out)       # a fresh node, the same command
        nodes.append(c)
        n_alone = len(a.steps())
        _wait("nodes a and c at WORLD_SIZE=2", lambda: any(
            s["world"] == 2 for s in a.steps()[n_alone:]) and any(
            s["world"] == 2 for s in c.steps()), nodes)
        (out / "DONE").write_text("")
        rc_a, rc_c = a.proc.wait(60), c.proc.wait(60)
        assert (rc_a, rc_c) == (0, 0), a.text() + c.text()
    finally:
        for n in nodes:
            if n.proc.poll() is None:
                n.kill_everything()

    steps_a = a.steps()
    # the world went 2 -> 1 -> 2 on node a, and every step's all-reduce saw the whole world
    worlds = [s["world"] for s in steps_a]
    assert worlds[-1] == 2 and [2, 1, 2] == [w for i, w in enumerate(worlds[n_before - 1:])
                                            if i == 0 or w != worlds[n_before - 2 + i]], worlds
    assert all(s["sum"] == s["world"] for s in steps_a + c.steps())
    # torchrun's variables follow each round: the node rank comes from the rendezvous
    for s in steps_a + c.steps():
        env = s["env"]
        assert env["NODE_RANK"] == env["GROUP_RANK"] == str(s["rank"]), s
        assert env["ROLE_WORLD_SIZE"] == str(s["world"]) and env["LOCAL_RANK"] == "0", s
        assert env["MASTER_ADDR"] == "127.0.0.1", s
    last = steps_a[-1]["env"]        # a join spends no restart: 3 - 1 failure left
    assert int(last["TORCHELASTIC_MAX_RESTARTS"]) - int(last["TORCHELASTIC_RESTART_COUNT"]) \
        == 2, last
    assert {steps_a[-1]["env"]["GROUP_RANK"], c.steps()[-1]["env"]["GROUP_RANK"]} == {"0", "1"}
    # the step never went back past the checkpoint: each restart resumes after the last step
    # checkpointed (at most the one step in flight is done again)
    by_pid: dict[int, list[int]] = {}
    for s in steps_a:
        by_pid.setdefault(s["pid"], []).append(s["step"])
    runs = list(by_pid.values())
    for prev, nxt in zip(runs, runs[1:]):
        assert nxt[0] >= prev[-1], runs
        assert nxt == list(range(nxt[0], nxt[0] + len(nxt))), nxt
    assert c.steps()[0]["first"] >= runs[-2][-1]         # the new node resumed too
    text = a.text()
    assert "world size 2 -> 1" in text and "world size 1 -> 2" in text, text
    assert "a node waits to join" in text, text
    status = json.loads((a.run_dir() / "status.json").read_text())
    assert status["state"] == "SUCCEEDED" and status["world_size"] == 2, status
    hist = status["history"][-2:]                  # (before them: grown from 1 to 2, maybe)
    assert [h["world_size"] for h in hist] == [2, 1], hist     # failed at 2, resized at 1
    assert [h["membership"] for h in hist] == [False, True], hist
    assert hist[0]["failures"], hist
    # --log-dir: torchrun's layout, this node's ranks by local rank, whatever their global rank
    (job,) = [d for d in (tmp_path / "logs").iterdir() if str(d) in text]
    attempts = sorted(job.iterdir())
    assert len(attempts) == status["attempt"] + 1, attempts
    assert all("STEP" in (d / "0" / "stdout.log").read_text() for d in attempts)
    for n in nodes:
        assert_no_survivors(n.run_dir())


def test_placement_takes_torchruns_rendezvous_timings(capsys):
    from gpulaunch import cli, cli_nodes, cli_torchrun, options
    from gpulaunch.tracking import Tracking
    args = cli.build_parser().parse_args([
        "run", "--nnodes", "1:3", "--rdzv-endpoint", "127.0.0.1:29400", "--rdzv-id", "j",
        "--rdzv-conf", "last_call_timeout=2,keep_alive_interval=1.5,keep_alive_max_attempt=4",
        "x.py"])
    cli_torchrun.apply(args, options.from_cli(args, tracking=Tracking(enabled=False)))
    p = cli_nodes.placement(args)
    assert (p.elastic, p.min_nodes, p.nnodes, p.master_addr, p.master_port, p.rdzv_id) == \
        (True, 1, 3, "127.0.0.1", 29400, "gpulaunch-j")
    assert (p.last_call_timeout, p.keep_alive_interval, p.keep_alive_max_attempt) == (2, 1.5, 4)
    assert not p.stop_on_peer_failure
    assert "elastic, 1 to 3 nodes" in capsys.readouterr().err
    args.tr_rdzv_conf = "keep_alive_max_attempt=0"
    with pytest.raises(ConfigurationError, match="must be > 0"):
        cli_nodes.placement(args)


@pytest.mark.parametrize("flags, message", [
    (dict(nnodes="3:2"), "MIN is larger than MAX"),
    (dict(nnodes="0:2"), "needs at least 1 node"),
    (dict(nnodes="a:b"), "give a number of nodes"),
    (dict(nnodes="1:x"), "a range MIN:MAX"),
    (dict(nnodes="1:2"), "needs the rendezvous endpoint"),
    (dict(nnodes="1:2", node_rank=0, rdzv_endpoint="h:1"), "drop --node-rank 0"),
])
def test_bad_ranges_are_refused_by_name(flags, message):
    with pytest.raises(ConfigurationError, match=message):
        cluster_env.detect({}, **flags)


def test_range_and_fixed_count():
    c = cluster_env.detect({}, nnodes="1:4", rdzv_endpoint="10.0.0.1:29400", rdzv_id="j")
    assert (c.elastic, c.min_nodes, c.nnodes, c.master_addr, c.master_port) == \
        (True, 1, 4, "10.0.0.1", 29400)
    assert "elastic, 1 to 4 nodes" in c.describe()
    fixed = cluster_env.detect({}, nnodes="2:2", node_rank=1, master_addr="h")
    assert (fixed.elastic, fixed.nnodes, fixed.node_rank) == (False, 2, 1)
    pet = cluster_env.detect({"PET_NNODES": "2:3", "PET_RDZV_ENDPOINT": "h:5",
                              "PET_NODE_RANK": "0"})
    assert (pet.elastic, pet.min_nodes, pet.nnodes) == (True, 2, 3)


def test_cli_refuses_node_rank_with_a_range_before_anything_starts(tmp_path):
    p = subprocess.run([PY, "-m", "gpulaunch.cli", "run", "--nnodes", "1:2", "--node-rank", "1",
                        "--rdzv-endpoint", "127.0.0.1:29400", "x.py"],
                       env=python_env({"GPULAUNCH_HOME": str(tmp_path)}),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "drop --node-rank 1" in p.stderr, p.stderr
    assert not (tmp_path / "runs").exists()


def test_losing_the_node_that_hosts_the_rendezvous_ends_the_others_clearly(tmp_path):
    """As with torchrun's c10d rendezvous, the first node on the endpoint's host hosts its
    store: when that node dies the job cannot go on; the other node ends, saying why, and
    leaves no process behind."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    port = _free_port()
    nodes = []
    try:
        a = Node(tmp_path, "a", port, script, out)
        nodes.append(a)
        _wait("node a to host the rendezvous", lambda: _listening(port), nodes)
        b = Node(tmp_path, "b", port, script, out)
        nodes.append(b)
        _wait("node b at WORLD_SIZE=2", lambda: any(s["world"] == 2 for s in b.steps()), nodes)
        a.kill_everything()
        rc = b.proc.wait(60)
    finally:
        for n in nodes:
            if n.proc.poll() is None:
                n.kill_everything()
    text = b.text()
    assert rc != 0, text
    assert "elastic rendezvous at 127.0.0.1" in text and "hosting it" in text, text
    assert_no_survivors(b.run_dir())
