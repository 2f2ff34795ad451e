"""A torchrun-style script behaves the same under ``gpulaunch run`` and under torchrun itself:
a different torch seed per rank, stderr on the launcher's stderr, an absolute ``__file__``,
``TORCHELASTIC_ERROR_FILE`` set (``@record`` writes it), the same exit status, the same
outputs, and ranks that ``pgrep -f train.py`` finds. Real processes, both launchers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import PY, python_env

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
PROBE = r'''
import json, os, sys, time
import torch
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    rank = int(os.environ["RANK"])
    gen = torch.Generator().manual_seed(1234)       # a seeded stream: equal under both
    # one write per record: under torchrun both ranks share the caller's pipe, and with
    # PYTHONUNBUFFERED (the test command sets it) print() writes the text and its newline
    # separately, so another rank's record could land between them on the same line
    sys.stdout.write(json.dumps({"rank": rank, "seed": torch.initial_seed(), "file": __file__,
                                 "argv": sys.argv[1:], "role": os.environ.get("ROLE_NAME"),
                                 "error_file": bool(os.environ.get("TORCHELASTIC_ERROR_FILE")),
                                 "seeded": torch.rand(2, generator=gen).tolist()}) + "\n")
    sys.stdout.flush()
    print(f"on-stderr {rank}", file=sys.stderr, flush=True)
    if "--wait" in sys.argv:
        with open(f"{sys.argv[-1]}.{rank}", "w") as f:
            f.write(str(os.getpid()))
        while not os.path.exists(sys.argv[-1] + ".go"):
            time.sleep(0.05)
    if "--fail" in sys.argv and rank == 1:
        raise ValueError("boom on rank 1")

main()
'''


def launch(launcher: str, script: Path, *args: str, flags=(), timeout=180):
    if launcher == "torchrun":
        cmd = [TORCHRUN, *flags, str(script.name), *args]
    else:
        cmd = [PY, "-m", "gpulaunch.cli", "run", "--no-tracking", *flags, script.name, *args]
    return subprocess.run(cmd, cwd=script.parent, env=python_env(), capture_output=True,
                          text=True, timeout=timeout)


def records(stdout: str) -> dict[int, dict]:
    out = {}
    for line in stdout.splitlines():
        line = re.sub(r"^\[rank \d+\] ", "", line)
        if line.startswith("{"):
            rec = json.loads(line)
            out[rec["rank"]] = rec
    return out


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(PROBE)
    return path


FLAGS = ["--nnodes=1", "--nproc_per_node=2", "--rdzv_id=101", "--rdzv_endpoint=localhost:5972"]


@pytest.mark.slow
def test_same_script_same_behaviour_under_torchrun_and_gpulaunch(script):
    seen = {}
    for launcher in ("torchrun", "gpulaunch"):
        ok = launch(launcher, script, "--lr", "3", flags=FLAGS + ["--role", "trainer"])
        assert ok.returncode == 0, (launcher, ok.stdout, ok.stderr)
        recs = records(ok.stdout)
        assert sorted(recs) == [0, 1], (launcher, ok.stdout)
        assert recs[0]["seed"] != recs[1]["seed"], f"{launcher}: equal torch seeds per rank"
        for r, rec in recs.items():
            assert rec["file"] == str(script), launcher          # absolute, as torchrun's
            assert rec["error_file"], f"{launcher}: TORCHELASTIC_ERROR_FILE unset"
            assert f"on-stderr {r}" in ok.stderr and f"on-stderr {r}" not in ok.stdout, launcher
        seen[launcher] = {r: {k: v for k, v in rec.items() if k != "seed"}
                          for r, rec in recs.items()}
    assert seen["torchrun"] == seen["gpulaunch"]     # argv, role, seeded stream, file...

    for launcher in ("torchrun", "gpulaunch"):
        bad = launch(launcher, script, "--fail", flags=FLAGS)
        assert bad.returncode != 0, launcher                 # torchrun: 1; gpulaunch: 1
        assert "boom on rank 1" in bad.stderr, (launcher, bad.stderr[-2000:])
        assert len(records(bad.stdout)) == 2, launcher


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "gpulaunch"])
def test_ps_and_pgrep_find_the_ranks_by_script_name(script, tmp_path, launcher):
    flag = tmp_path / f"ready-{launcher}"
    cmd = ([TORCHRUN] if launcher == "torchrun" else
           [PY, "-m", "gpulaunch.cli", "run", "--no-tracking"]) + \
        ["--nproc-per-node", "2", script.name, "--wait", str(flag)]
    proc = subprocess.Popen(cmd, cwd=script.parent, env=python_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not all(os.path.exists(f"{flag}.{r}") for r in (0, 1)):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        found = subprocess.run(["pgrep", "-f", "train.py --wait"], capture_output=True,
                               text=True).stdout.split()
        pids = {int(Path(f"{flag}.{r}").read_text()) for r in (0, 1)}
        assert pids <= {int(p) for p in found}, (launcher, found, pids)
        assert "train.py --wait" in " ".join(psutil.Process(min(pids)).cmdline())
    finally:
        Path(f"{flag}.go").touch()
        proc.wait(timeout=60)
    assert proc.returncode == 0


@pytest.mark.slow
def test_log_dir_redirects_and_filters_as_torchrun_lays_them_out(script, tmp_path):
    logs = tmp_path / "logs"
    ok = launch("gpulaunch", script, flags=["--nproc_per_node", "2", "--rdzv_id", "job7",
                                            "--log_dir", str(logs), "--redirects", "0:3",
                                            "--local_ranks_filter", "0,1",
                                            "--duplicate_stdout_filters", "seeded"])
    assert ok.returncode == 0, ok.stderr
    assert "on-stderr 0" not in ok.stderr and "on-stderr 1" in ok.stderr     # rank 0 redirected
    assert '"rank": 0' not in ok.stdout and '"rank": 1' in ok.stdout
    (job,) = logs.glob("job7_*")
    for r in (0, 1):
        assert (job / "attempt_0" / str(r) / "stderr.log").read_text() == f"on-stderr {r}\n"
        out = (job / "attempt_0" / str(r) / "stdout.log").read_text()
        assert json.loads(out)["rank"] == r
    assert len((job / "attempt_0" / "filtered_stdout.log").read_text().splitlines()) == 2


@pytest.mark.slow
def test_the_error_file_that_record_writes_is_read_by_the_launcher(script):
    """A command gpulaunch does not wrap (--no-python): its failure reaches the caller through
    torchelastic's error file, as torchrun reads it."""
    bad = launch("gpulaunch", script, "--fail", flags=["--nproc-per-node", "2", "--no-python",
                                                        sys.executable])
    assert bad.returncode != 0
    assert "torchelastic error file" in bad.stderr and "boom on rank 1" in bad.stderr, \
        bad.stderr[-3000:]
