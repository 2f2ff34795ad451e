"""``gpulaunch run --nnodes 2 ... --start-timeout S`` with a node that never comes: the launch
fails after about S seconds (not the store's fixed 600 s) and names what is missing."""

from __future__ import annotations

import socket
import subprocess
import time

import pytest
from conftest import PY, python_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node(tmp_path, rank: int, port: int, timeout: float = 8):
    script = tmp_path / "hi.py"
    script.write_text("print('hi')\n")
    t0 = time.monotonic()
    p = subprocess.run([PY, "-m", "gpulaunch.cli", "run", "--no-tracking", "--nnodes", "2",
                        "--node_rank", str(rank), "--master_addr", "127.0.0.1", "--master_port",
                        str(port), "--nproc-per-node", "1", "--start-timeout", str(timeout),
                        "--timeout", "300", str(script)],
                       env=python_env(), capture_output=True, text=True, timeout=300)
    return p, time.monotonic() - t0


@pytest.mark.slow
def test_node_0_names_the_node_that_never_joined(tmp_path):
    p, took = node(tmp_path, 0, free_port())
    assert p.returncode != 0
    assert "node 1 of 2 did not join the rendezvous" in p.stderr, p.stderr[-2000:]
    assert "within 8 s (start_timeout)" in p.stderr
    assert took < 120, took        # bounded by start_timeout, not the 600 s store timeout


@pytest.mark.slow
def test_a_node_that_cannot_reach_node_0_says_where_it_looked(tmp_path):
    port = free_port()
    p, took = node(tmp_path, 1, port)
    assert p.returncode != 0
    assert f"could not reach node 0's rendezvous store at 127.0.0.1:{port}" in p.stderr, \
        p.stderr[-2000:]
    assert took < 120, took
