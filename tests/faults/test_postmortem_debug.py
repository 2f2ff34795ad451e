"""Post-mortem debugging of a real failing rank: the failing frame's locals in the error and
the run directory, and a scripted pdb session (``p x``, ``where``, ``c``) through
``gpulaunch debug RUN --rank N`` that reads a local and ends the run with no process left."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from conftest import ROOT, assert_no_survivors

from gpulaunch import distributed
from gpulaunch.common.rundir import RunDir


def _breaks(scale):
    import torch

    from gpulaunch import runtime as rt

    def failing_step(batch, x):
        label = "step " * 100                                   # a long repr gets cut
        if rt.get_global_rank() == 1:
            raise ArithmeticError(f"broke with {len(label)}")
        return float(batch.sum()) + x

    return failing_step(torch.ones(4, 8), scale * 6)


def test_the_error_shows_the_failing_frames_locals():
    with pytest.raises(ArithmeticError) as info:
        distributed(gpus=2, stream_logs="none")(_breaks).distributed(7)
    text = str(info.value.__cause__ or "") + getattr(info.value, "remote_traceback", "")
    assert "Local variables of the failing frame (failing_step at" in text, text
    assert "x: int = 42" in text
    assert "batch: torch.Tensor shape (4, 8) torch.float32 on cpu" in text
    run = RunDir(info.value.run_dir)
    saved = json.loads(run.rank_file(0, 1, "locals.json").read_text())
    label = next(v for v in saved["locals"] if v["name"] == "label")
    assert label["type"] == "str" and len(label["repr"]) <= 160 and "..." in label["repr"]
    assert not run.rank_file(0, 0, "locals.json").exists()     # rank 0 did not fail


def _debug_info(run: RunDir, rank: int, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    path = run.rank_file(0, rank, "debug.json")
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        time.sleep(0.1)
    raise AssertionError(f"no {path}")


def test_a_scripted_pdb_session_reads_a_local_and_ends_the_run(gpulaunch_home):
    h = distributed(gpus=2, stream_logs="none", debug=True)(_breaks).submit(7)
    run = RunDir(h.run_dir)
    info = _debug_info(run, 1)
    assert oct(os.stat(run.rank_file(0, 1, "debug.json")).st_mode & 0o777) == "0o600"
    assert info["port"] and len(info["token"]) >= 24

    with socket.create_connection(("127.0.0.1", info["port"]), timeout=10) as bad:
        bad.sendall(b"not-the-token\n")                       # refused; the rank goes on waiting
        assert b"wrong token" in bad.recv(100)
    assert not h.done() and h.status.value == "RUNNING"

    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    p = subprocess.run([sys.executable, "-m", "gpulaunch.cli", "debug", h.run_id, "--rank", "1"],
                       input="p x\nwhere\np batch.shape\nc\n", capture_output=True, text=True,
                       timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    assert "gpulaunch: attached" in p.stdout
    assert "(Pdb) 42\n" in p.stdout                          # p x
    assert "-> raise ArithmeticError" in p.stdout             # where: the raising line
    assert "failing_step()" in p.stdout and "_breaks()" in p.stdout
    assert "torch.Size([4, 8])" in p.stdout

    with pytest.raises(ArithmeticError):
        h.result(timeout=60)                                  # the run ended by itself
    assert not run.rank_file(0, 1, "debug.json").exists()
    with pytest.raises(OSError):                              # one session: nothing listens
        socket.create_connection(("127.0.0.1", info["port"]), timeout=2).close()
    assert_no_survivors(h.run_dir)
