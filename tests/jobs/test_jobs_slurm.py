"""Jobs on a real single-host Slurm (tests/slurm_cluster.py): each attempt is an sbatch job
whose srun step runs the attempt; ``job get`` follows Slurm's state, retries get a fresh
allocation, ``job cancel`` is scancel and leaves nothing running.

Skipped when Slurm cannot start here; ``GPULAUNCH_REQUIRE_SLURM=1`` makes that a failure."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import PY
from jobhelp import assert_nothing_left, get, gl, wait_for, wait_state, write_job
from slurm_cluster import NotStartable, SlurmCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

SLURM = """\
compute:
  where: slurm
  gpus: 2
  slurm:
    request_gpus: false
    time: "00:10:00"
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except NotStartable as e:
        cluster.stop()
        why = f"no single-host Slurm here: {e}"
        if os.environ.get("GPULAUNCH_REQUIRE_SLURM") == "1":
            pytest.fail(f"{why}\n(GPULAUNCH_REQUIRE_SLURM=1: Slurm is installed, so it must run)")
        pytest.skip(why)
    except BaseException:
        cluster.stop()
        raise
    try:
        yield cluster
    finally:
        left = cluster.stop()
    assert not left, f"processes of the Slurm cluster outlived its daemons: {left}"


def _env(slurm: SlurmCluster) -> dict:
    """The submitting shell: Slurm's config, the venv first on PATH (the job's python)."""
    env = slurm.env({"GPULAUNCH_QUIET": "1"})
    env["PATH"] = os.pathsep.join([str(Path(PY).parent), env.get("PATH", "")])
    env["GPULAUNCH_HOME"] = os.environ["GPULAUNCH_HOME"]
    return env


def _spec(tmp_path, extra: str = ""):
    spec = write_job(tmp_path)
    text = spec.read_text().replace("compute:\n  gpus: 2\n", SLURM)
    spec.write_text(text + extra)
    return spec


def test_dry_run_prints_the_sbatch_script(tmp_path, gpulaunch_home):
    p = gl("job", "run", _spec(tmp_path), "--dry-run")
    for line in ("#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1", "#SBATCH --time=00:10:00",
                 "exec srun --ntasks-per-node=1 --kill-on-bad-exit=1"):
        assert line in p.stdout, p.stdout
    assert "--gpus-per-node" not in p.stdout
    assert not (gpulaunch_home / "jobs").exists()


def test_slurm_job_runs_and_retries_in_fresh_allocations(slurm, tmp_path, gpulaunch_home):
    env = _env(slurm)
    ok = gl("job", "run", _spec(tmp_path), env=env).stdout.strip()
    d = wait_state(ok)
    assert d["state"] == "SUCCEEDED", d
    sid = d["attempts"][0]["slurm_job_id"]
    assert slurm.cmd(["scontrol", "show", "job", "-o", sid]).stdout.count(
        "JobState=COMPLETED") == 1
    logs = gl("job", "logs", ok).stdout
    assert "[rank 0] rank 0 sum 3.0" in logs and "[rank 1] rank 1 done" in logs, logs
    assert f"rendezvous id '{sid}' (from Slurm" in logs, logs

    failing = _spec(tmp_path, "environment:\n  env: {FAIL_RANK: '1'}\n"
                              "retry: {max_retries: 1, backoff: 0.2}\n")
    bad = gl("job", "run", failing, env=env).stdout.strip()
    d = wait_state(bad)
    assert d["state"] == "FAILED" and len(d["attempts"]) == 2, d
    ids = [a["slurm_job_id"] for a in d["attempts"]]
    assert len(set(ids)) == 2, ids                     # one allocation per attempt
    for a in d["attempts"]:
        assert a["cause"] == "rank 1 raised ValueError: boom on rank 1", a
    for sid in ids:
        assert "JobState=FAILED" in slurm.cmd(["scontrol", "show", "job", "-o", sid]).stdout


def test_cancel_is_scancel_and_leaves_nothing(slurm, tmp_path, gpulaunch_home):
    go = tmp_path / "never"
    spec = _spec(tmp_path, f"environment:\n  env: {{WAIT_FILE: '{go}'}}\n")
    job_id = gl("job", "run", spec, env=_env(slurm)).stdout.strip()
    wait_for("both ranks up", lambda: all((tmp_path / f"never.rank{r}").exists()
                                          for r in (0, 1)))
    assert get(job_id)["state"] == "RUNNING"
    sid = get(job_id)["attempts"][0]["slurm_job_id"]
    out = json.loads(gl("job", "cancel", job_id, "--json", env=_env(slurm)).stdout)
    assert out["state"] == "CANCELLED", out
    assert "JobState=CANCELLED" in slurm.cmd(["scontrol", "show", "job", "-o", sid]).stdout
    d = get(job_id)
    assert d["attempts"][0]["state"] == "CANCELLED", d
    assert_nothing_left(gpulaunch_home, job_id, wait=30)
