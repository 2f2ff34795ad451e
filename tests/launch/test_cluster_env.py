"""caller/cluster_env.py: where a node sits in a multi-node job, from flags, torchrun's PET_*
variables, Slurm, or a PyTorchJob's MASTER_ADDR/WORLD_SIZE/RANK. Pure functions, real inputs."""

from __future__ import annotations

import pytest

from gpulaunch.caller import cluster_env, netroute
from gpulaunch.caller.cluster_env import ClusterEnv, detect, parse_nodelist, split_endpoint
from gpulaunch.errors import ConfigurationError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("text, hosts", [
    ("node01", ["node01"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a[1-2],b,c[9-10]", ["a1", "a2", "b", "c9", "c10"]),
    ("gpu-[008-010]-ib", ["gpu-008-ib", "gpu-009-ib", "gpu-010-ib"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    (" login , x[3] ", ["login", "x3"]),
])
def test_slurm_nodelist_expands(text, hosts):
    assert parse_nodelist(text) == hosts


@pytest.mark.parametrize("bad", ["node[01-03", "node01]", "n[a-b]", "n[1-]"])
def test_slurm_nodelist_refuses_malformed_lists(bad):
    with pytest.raises(ValueError, match="Slurm host list"):
        parse_nodelist(bad)


def test_endpoint_forms():
    assert split_endpoint("10.0.0.1:1234") == ("10.0.0.1", 1234)
    assert split_endpoint("head") == ("head", 29500)
    assert split_endpoint("[fd00::1]:99") == ("fd00::1", 99)
    with pytest.raises(ConfigurationError, match="HOST:PORT"):
        split_endpoint("head:port")


def test_nothing_set_is_one_node():
    c = detect({})
    assert c == ClusterEnv() and not c.multi_node


def test_flags_as_torchrun_takes_them():
    c = detect({}, nnodes="2", node_rank=1, master_addr="10.1.1.1", master_port=4000,
               rdzv_id="job7")
    assert (c.nnodes, c.node_rank, c.master_addr, c.master_port, c.rdzv_id, c.source) == \
        (2, 1, "10.1.1.1", 4000, "job7", "flags")
    c = detect({}, nnodes="3:3", node_rank=2, rdzv_endpoint="head:5000")
    assert (c.nnodes, c.master_addr, c.master_port, c.rdzv_id) == (3, "head", 5000, "none")


@pytest.mark.parametrize("kw, message", [
    (dict(nnodes="2", master_addr="h"), "needs --node-rank"),
    (dict(nnodes="2", node_rank=0), "needs --master-addr"),
    (dict(nnodes="2", node_rank=2, master_addr="h"), "outside 0...1"),
    (dict(nnodes="1:4", node_rank=0, master_addr="h"), "drop --node-rank 0"),
    (dict(nnodes="1:4"), "needs the rendezvous endpoint"),
    (dict(nnodes="4:1", rdzv_endpoint="h:1"), "MIN is larger than MAX"),
    (dict(nnodes="two"), "give a number of nodes"),
    (dict(nnodes="2", node_rank=0, master_addr="a", rdzv_endpoint="b:1"), "different hosts"),
    (dict(nnodes="2", node_rank=0, master_port=1, rdzv_endpoint="b:2"), "different ports"),
    (dict(nnodes="2", node_rank=0, master_addr="h", master_port=70000), "not a TCP port"),
])
def test_bad_flags_are_refused_by_name(kw, message):
    with pytest.raises(ConfigurationError, match=message):
        detect({}, **kw)


SLURM = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NNODES": "3", "SLURM_NODEID": "2",
         "SLURM_NTASKS": "3", "SLURM_JOB_NODELIST": "gpu[07-09]"}


def test_slurm_inside_srun():
    c = detect(SLURM)
    assert (c.nnodes, c.node_rank, c.master_addr, c.master_port, c.rdzv_id) == \
        (3, 2, "gpu07", 29500, "4242")
    assert "Slurm" in c.source
    assert detect({**SLURM, "MASTER_PORT": "6000"}).master_port == 6000


def test_slurm_one_node_step_keeps_the_job_id():
    # srun -N1: one node, but the job id still names the rendezvous (cli.py records it).
    one = {**SLURM, "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_NTASKS": "1",
           "SLURM_JOB_NODELIST": "gpu07"}
    c = detect(one)
    assert (c.multi_node, c.rdzv_id) == (False, "4242") and "Slurm" in c.source
    assert (detect({}).rdzv_id, detect({}).source) == ("none", "single node")
    assert (detect({}, rdzv_id="j1").rdzv_id, detect({}, rdzv_id="j1").source) == ("j1", "flags")


def test_slurm_batch_script_without_srun_is_one_node():
    # The batch step (no SLURM_STEP_ID) runs on the first node only: it is not a node of a
    # multi-node launch, or node 0 would wait forever for the others.
    env = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    assert not detect(env).multi_node


def test_slurm_with_several_tasks_per_node_is_refused():
    with pytest.raises(ConfigurationError, match="--ntasks-per-node=1"):
        detect({**SLURM, "SLURM_NTASKS": "24"})


def test_flags_win_over_slurm():
    c = detect(SLURM, nnodes="2", node_rank=0, master_addr="other")
    assert (c.nnodes, c.master_addr, c.source) == (2, "other", "flags")


def test_pytorchjob_node_level_variables():
    env = {"MASTER_ADDR": "train-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "4",
           "RANK": "3"}
    c = detect(env)
    assert (c.nnodes, c.node_rank, c.master_addr, c.master_port) == (4, 3, "train-master-0",
                                                                      23456)
    # Inside a rank the same names mean ranks, not nodes: never read them there.
    assert not detect({**env, "LOCAL_RANK": "0"}).multi_node


def test_torchrun_pet_variables():
    env = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "m", "PET_MASTER_PORT":
           "777", "WORLD_SIZE": "16", "RANK": "9", "MASTER_ADDR": "ignored"}
    c = detect(env)
    assert (c.nnodes, c.node_rank, c.master_addr, c.master_port) == (2, 1, "m", 777)


def test_loopback_route_and_interface():
    assert netroute.local_ip_towards("127.0.0.1") == "127.0.0.1"
    assert netroute.interface_of("127.0.0.1") == "lo"
    with pytest.raises(ConfigurationError, match="does not resolve"):
        netroute.resolve("no-such-host.invalid")


def test_describe_names_the_source():
    text = detect(SLURM).describe()
    assert "node 2 of 3" in text and "gpu07:29500" in text and "Slurm" in text
    assert cluster_env.DEFAULT_MASTER_PORT == 29500
