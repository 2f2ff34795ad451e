"""``gpulaunch run --preempt-grace S script.py``: SIGTERM to the launcher is a preemption notice;
the script's loop saves its step (``parallel.save_on_preemption``), the launcher exits non-zero
saying so, and the next start resumes at that step (real ranks, a real signal)."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import PY, assert_no_survivors, latest_run_dir, python_env

SCRIPT = """
import sys, time, torch
from gpulaunch import runtime as rt
from gpulaunch.parallel import prepare, resume, save_on_preemption
rt.init()
torch.manual_seed(0)
p = prepare(torch.nn.Linear(4, 1), lambda ps: torch.optim.SGD(ps, lr=0.1), strategy="ddp")
ckpt, steps = sys.argv[1], int(sys.argv[2])
step = start = resume(ckpt, p)
while step < steps:
    p.backward(p.model(torch.ones(2, 4)).pow(2).mean()); p.step(); p.zero_grad()
    step += 1
    if rt.is_main():
        open(ckpt + ".prog", "a").write(f"{step}\\n")
    save_on_preemption(ckpt, p, step=step)
    time.sleep(0.05)
rt.print0("START", start, "END", step)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_signal_to_gpulaunch_run_checkpoints_and_the_next_run_resumes(tmp_path,
                                                                        gpulaunch_home, sig):
    """SIGTERM: Kubernetes; SIGUSR1: Slurm's ``--signal=B:USR1@N`` to an exec'd launcher."""
    script, ckpt = tmp_path / "train.py", str(tmp_path / "ck")
    script.write_text(SCRIPT)
    cmd = [PY, "-m", "gpulaunch", "run", "--nproc-per-node", "2"]
    first = subprocess.Popen(cmd + ["--preempt-grace", "20", str(script), ckpt, "100000"],
                             env=python_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    prog = Path(ckpt + ".prog")
    deadline = time.monotonic() + 120
    while not (prog.exists() and len(prog.read_text().split()) >= 4):
        assert time.monotonic() < deadline and first.poll() is None, "never reached step 4"
        time.sleep(0.05)
    first.send_signal(sig)
    out, _ = first.communicate(timeout=90)
    assert first.returncode != 0
    m = re.search(rf"gpulaunch: Preempted \({sig.name} to the caller, grace 20 s\): checkpoint of "
                  r"step (\d+) saved in .*the next start resumes from it", out)
    assert m, out[-3000:]
    assert_no_survivors(latest_run_dir(gpulaunch_home))
    second = subprocess.run(cmd + [str(script), ckpt, str(int(m.group(1)) + 3)],
                            env=python_env(), capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert f"START {m.group(1)} END {int(m.group(1)) + 3}" in second.stdout


def _start_in_training(cmd, ckpt, env=None):
    proc = subprocess.Popen(cmd, env=env or python_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    prog = Path(ckpt + ".prog")
    deadline = time.monotonic() + 120
    while not (prog.exists() and len(prog.read_text().split()) >= 4):
        assert time.monotonic() < deadline and proc.poll() is None, "never reached step 4"
        time.sleep(0.05)
    return proc


def test_gpulaunch_preempt_from_another_process_checkpoints_and_the_next_run_resumes(
        tmp_path, gpulaunch_home):
    """A Kubernetes preStop hook's command: the notice of another process, which the caller
    finds in its run directory; the ranks save (``--wait`` returns then, saying which step),
    the caller exits saying so, and the next start resumes. Then the run has ended: a second
    ``gpulaunch preempt`` says so."""
    script, ckpt = tmp_path / "train.py", str(tmp_path / "ck")
    script.write_text(SCRIPT)
    cmd = [PY, "-m", "gpulaunch", "run", "--nproc-per-node", "2"]
    first = _start_in_training(cmd + ["--preempt-grace", "20", str(script), ckpt, "100000"],
                               ckpt)
    run_id = latest_run_dir(gpulaunch_home).name
    hook = subprocess.run([PY, "-m", "gpulaunch", "preempt", "--grace", "20", "--wait"],
                          env=python_env(), capture_output=True, text=True, timeout=60)
    assert hook.returncode == 0, hook.stdout + hook.stderr
    assert f"gpulaunch: preemption notice posted to run {run_id}: its ranks save a checkpoint " \
           "within 20 s" in hook.stdout, hook.stdout
    out, _ = first.communicate(timeout=90)
    assert first.returncode != 0
    m = re.search(r"gpulaunch: Preempted \(gpulaunch preempt from pid \d+, grace 20 s\): "
                  r"checkpoint of step (\d+) saved in .*the next start resumes from it", out)
    assert m, out[-3000:]
    assert f"gpulaunch: run {run_id}: checkpoint of step {m.group(1)} saved in " in hook.stdout
    assert_no_survivors(latest_run_dir(gpulaunch_home))
    again = subprocess.run([PY, "-m", "gpulaunch", "preempt", run_id], env=python_env(),
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and f"run {run_id} cannot take a preemption notice: it has " \
        "ended" in again.stderr, again.stderr
    none = subprocess.run([PY, "-m", "gpulaunch", "preempt", "--all"], env=python_env(),
                          capture_output=True, text=True, timeout=60)
    assert none.returncode == 2 and "no running run on this host" in none.stderr, none.stderr
    second = subprocess.run(cmd + [str(script), ckpt, str(int(m.group(1)) + 3)],
                            env=python_env(), capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert f"START {m.group(1)} END {int(m.group(1)) + 3}" in second.stdout


def test_gpulaunch_run_preempt_watch_turns_a_gcp_notice_into_a_checkpoint(tmp_path,
                                                                          gpulaunch_home):
    from metadata_server import MetadataServer
    script, ckpt = tmp_path / "train.py", str(tmp_path / "ck")
    script.write_text(SCRIPT)
    with MetadataServer("gcp") as server:
        env = python_env({"GPULAUNCH_METADATA_URL": server.url})
        first = _start_in_training([PY, "-m", "gpulaunch", "run", "--nproc-per-node", "2",
                                    "--preempt-watch", "gcp", str(script), ckpt, "100000"],
                                   ckpt, env)
        server.notice()
        out, _ = first.communicate(timeout=90)
    assert first.returncode != 0
    assert re.search(r"gpulaunch: Preempted \(GCP instance/preempted: TRUE, grace 25 s\): "
                     r"checkpoint of step \d+ saved in .*the next start resumes from it", out), \
        out[-3000:]
    assert "cannot reach" not in out
    assert_no_survivors(latest_run_dir(gpulaunch_home))
