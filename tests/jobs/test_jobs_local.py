"""Jobs on this host, end to end with the real CLI and real processes: a detached supervisor,
attempts running two gloo ranks, retries, cancel, idempotency, --watch and logs."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
from conftest import PY, python_env
from jobhelp import assert_nothing_left, get, gl, wait_for, wait_state, write_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_job_survives_its_terminal_and_logs_have_everything(tmp_path, gpulaunch_home):
    spec = write_job(tmp_path)
    go = tmp_path / "go"
    # the submitting "terminal": its own session, like a shell over SSH, killed mid-job
    term = subprocess.Popen([PY, "-m", "gpulaunch.cli", "job", "run", spec, "--watch",
                             "--override", f"environment.env.WAIT_FILE={go}"],
                            env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, start_new_session=True, text=True)
    try:
        wait_for("both ranks up", lambda: all((tmp_path / f"go.rank{r}").exists()
                                              for r in (0, 1)))
        os.killpg(term.pid, signal.SIGHUP)          # the connection drops ...
        os.killpg(term.pid, signal.SIGKILL)         # ... and everything in its session dies
        term.wait(timeout=30)
    finally:
        if term.poll() is None:
            term.kill()
    job_id = term.stdout.read().splitlines()[0]
    assert get(job_id)["state"] == "RUNNING"
    go.touch()
    done = wait_state(job_id)
    assert done["state"] == "SUCCEEDED", done
    logs = gl("job", "logs", job_id).stdout.splitlines()
    for r in (0, 1):
        assert f"[rank {r}] rank {r} sum 3.0" in logs and f"[rank {r}] rank {r} done" in logs
    assert gl("job", "logs", job_id, "--rank", "1").stdout.splitlines() == \
        ["rank 1 sum 3.0", "rank 1 done"]
    assert_nothing_left(gpulaunch_home, job_id)


def test_watch_prints_what_logs_prints(tmp_path, gpulaunch_home):
    spec = write_job(tmp_path)
    p = gl("job", "run", spec, "--watch")
    job_id = p.stderr.split("job ")[1].split()[0]
    assert f"job {job_id}: SUCCEEDED" in p.stderr, p.stderr
    watched = p.stdout.splitlines()[1:]             # the first line is the job id
    assert watched == gl("job", "logs", job_id).stdout.splitlines()
    assert watched[0] == "=== attempt 1 ===" and "[rank 0] rank 0 done" in watched


def test_cancel_leaves_no_process(tmp_path, gpulaunch_home):
    go = tmp_path / "never"
    spec = write_job(tmp_path)
    job_id = gl("job", "run", spec, "--override",
                f"environment.env.WAIT_FILE={go}").stdout.strip()
    wait_for("both ranks up", lambda: all((tmp_path / f"never.rank{r}").exists()
                                          for r in (0, 1)))
    out = json.loads(gl("job", "cancel", job_id, "--json").stdout)
    assert out == {"job_id": job_id, "state": "CANCELLED", "changed": True}
    d = get(job_id)
    assert d["state"] == "CANCELLED" and d["attempts"][0]["state"] == "CANCELLED", d
    assert_nothing_left(gpulaunch_home, job_id, wait=5)
    # a second cancel says it is over
    again = json.loads(gl("job", "cancel", job_id, "--json").stdout)
    assert again["changed"] is False and again["state"] == "CANCELLED"


def test_idempotency_key_returns_the_first_job(tmp_path, gpulaunch_home):
    spec = write_job(tmp_path)
    first = json.loads(gl("job", "run", spec, "--idempotency-key", "nightly-42",
                          "--json").stdout)
    second = json.loads(gl("job", "run", spec, "--idempotency-key", "nightly-42",
                           "--json").stdout)
    assert first["existing"] is False
    assert second == {"job_id": first["job_id"], "existing": True,
                      "idempotency_key": "nightly-42"}
    assert wait_state(first["job_id"])["state"] == "SUCCEEDED"
    listed = json.loads(gl("job", "list", "--json").stdout)
    assert [j["job_id"] for j in listed] == [first["job_id"]]


def test_dry_run_starts_nothing(tmp_path, gpulaunch_home):
    spec = write_job(tmp_path)
    p = gl("job", "run", spec, "--dry-run", "--override", "compute.gpus=1")
    assert "# resolved spec (nothing was started)" in p.stdout
    assert "  gpus: 1" in p.stdout and "gpulaunch.jobs.attempt" in p.stdout, p.stdout
    assert not (gpulaunch_home / "jobs").exists() and not (gpulaunch_home / "runs").exists()
    assert not (gpulaunch_home / "snapshots").exists()
    d = json.loads(gl("job", "run", spec, "--dry-run", "--json").stdout)
    assert d["dry_run"] is True and d["spec"]["compute"]["gpus"] == 2 and d["code_files"] == 1


def test_bad_spec_fails_before_anything_starts(tmp_path, gpulaunch_home):
    spec = write_job(tmp_path, "launch:\n  timeout: soon\n")
    p = gl("job", "run", spec, check=False)
    assert p.returncode == 2
    assert "job.yaml:9: launch.timeout: timeout must be a positive number" in p.stderr, p.stderr
    assert not (gpulaunch_home / "jobs").exists()


def test_function_command_runs_under_distributed_semantics(tmp_path, gpulaunch_home):
    spec = write_job(tmp_path)
    (tmp_path / "code" / "fn.py").write_text(
        "from gpulaunch import runtime as rt\n"
        "def train(scale):\n"
        "    return {'rank': rt.get_global_rank(), 'value': scale * (rt.get_global_rank() + 1)}\n")
    text = spec.read_text().replace("script: train.py", "function: fn:train\n  kwargs:\n"
                                                        "    scale: 10")
    spec.write_text(text)
    job_id = gl("job", "run", spec).stdout.strip()
    d = wait_state(job_id)
    assert d["state"] == "SUCCEEDED", d
    assert d["attempts"][0]["results"] == ["{'rank': 0, 'value': 10}",
                                           "{'rank': 1, 'value': 20}"]


def test_a_killed_supervisor_takes_its_attempt_along_and_the_job_shows_lost(tmp_path,
                                                                            gpulaunch_home):
    """kill -9 of the supervisor (an OOM kill, a reboot): its attempt gets SIGTERM (parent
    death signal) and stops its ranks; the job reads LOST and cancel closes it."""
    go = tmp_path / "never"
    spec = write_job(tmp_path)
    job_id = gl("job", "run", spec, "--override",
                f"environment.env.WAIT_FILE={go}").stdout.strip()
    wait_for("both ranks up", lambda: all((tmp_path / f"never.rank{r}").exists()
                                          for r in (0, 1)))
    sup = json.loads((gpulaunch_home / "jobs" / job_id / "job.json").read_text())
    os.kill(sup["supervisor_pid"], signal.SIGKILL)
    assert_nothing_left(gpulaunch_home, job_id, wait=60)
    assert get(job_id)["state"] == "LOST"
    out = json.loads(gl("job", "cancel", job_id, "--json").stdout)
    assert out["state"] == "CANCELLED", out
    assert get(job_id)["cause"] == "cancelled (its supervisor was gone)"
