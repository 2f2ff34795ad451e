"""``gpulaunch run`` under a real Slurm: munged, slurmctld and slurmd on this host
(tests/slurm_cluster.py), jobs submitted with ``srun`` and ``sbatch`` as on a cluster. The
job runs the venv's Python with this checkout on PYTHONPATH (srun hands the submitting
environment to the job); two CPU ranks, gloo.

Skipped, with the daemons' log tail, when Slurm cannot start here (not installed, no root);
``GPULAUNCH_REQUIRE_SLURM=1`` (set by ``.ci/run`` once Slurm is installed) turns that into a
failure."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from conftest import PY, ROOT, assert_no_survivors, latest_run_dir, python_env
from slurm_cluster import NotStartable, SlurmCluster

pytestmark = pytest.mark.timeout(240)

SCRIPT = textwrap.dedent("""
    import os, socket, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    r = dist.get_rank()
    if os.environ.get("FAIL_RANK") == str(r):
        raise ValueError(f"boom on rank {r}")
    if os.environ.get("FAIL_RANK"):
        time.sleep(120)        # outside any collective: only gpulaunch can stop this rank
    t = torch.tensor([float(r + 1)])
    dist.all_reduce(t)
    e = os.environ
    print(f"rank {r} world {dist.get_world_size()} sum {t.item()} job {e['SLURM_JOB_ID']} "
          f"run_id {e['TORCHELASTIC_RUN_ID']} host {socket.gethostname()}", flush=True)
    dist.barrier()
""")


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


def _job_env(slurm: SlurmCluster, **extra) -> dict:
    """What the job gets from srun/sbatch: this checkout on PYTHONPATH, the venv first on PATH,
    the test's GPULAUNCH_HOME (autouse fixture), no tracking."""
    env = python_env()
    env["PATH"] = os.pathsep.join([str(Path(PY).parent), env.get("PATH", "")])
    return slurm.env({"GPULAUNCH_QUIET": "", **extra}, base=env)


def _gpulaunch() -> list[str]:
    """The venv's ``gpulaunch`` entry point when it is installed, else ``python -m``."""
    entry = Path(PY).parent / "gpulaunch"
    return [str(entry)] if entry.exists() else [PY, "-m", "gpulaunch.cli"]


def _job_state(slurm: SlurmCluster, name: str, final: bool = True) -> tuple[str, str]:
    """(job id, state) of the job named ``name``, from slurmctld (it keeps finished jobs for
    MinJobAge, 300 s). ``final``: right after srun returns the job may still be COMPLETING
    (its epilog): wait for its end state, bounded."""
    deadline = time.monotonic() + 60
    while True:
        out = slurm.cmd(["squeue", "-h", "-t", "all", "-n", name, "-o", "%i %T"]).stdout.split()
        assert len(out) == 2, f"squeue found no single job named {name}: {out}"
        if not final or out[1] not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING") or \
                time.monotonic() > deadline:
            return out[0], out[1]
        time.sleep(0.2)


def _rank_lines(text: str) -> list[str]:
    return sorted(line for line in text.splitlines() if " world " in line)


def test_srun_runs_two_cpu_ranks_under_the_slurm_job_id(slurm, tmp_path, gpulaunch_home):
    script = tmp_path / "allreduce.py"
    script.write_text(SCRIPT)
    name = f"gl-{uuid.uuid4().hex[:8]}"
    p, step = slurm.job(["srun", "-N1", "-n1", "--export=ALL", "-J", name, PY, "-m",
                         "gpulaunch.cli", "run", "--gpus", "2", "--no-tracking", str(script)],
                        env=_job_env(slurm), cwd=tmp_path)
    assert p.returncode == 0, p.stdout + "\n" + slurm.log_tail()
    job, state = _job_state(slurm, name)
    assert state == "COMPLETED"
    rid = f"gpulaunch-{job}"
    assert _rank_lines(p.stdout) == [
        f"[rank {r}] rank {r} world 2 sum 3.0 job {job} run_id {rid} host {slurm.host}"
        for r in (0, 1)], p.stdout
    # cluster_env: SLURM_JOB_ID is the rendezvous id, said on stderr and kept in the record
    assert f"one node, rendezvous id '{job}' (from Slurm" in p.stdout, p.stdout
    run_dir = latest_run_dir(gpulaunch_home)
    record = json.loads((run_dir / "launch.json").read_text())
    assert record["placement"]["rdzv_id"] == rid and record["placement"]["nnodes"] == 1
    assert_no_survivors(run_dir)
    assert slurm.leftovers_of(step) == []


def test_srun_failing_rank_fails_the_step_and_leaves_nothing(slurm, tmp_path, gpulaunch_home):
    script = tmp_path / "fails.py"
    script.write_text(SCRIPT)
    name = f"gl-{uuid.uuid4().hex[:8]}"
    p, step = slurm.job(["srun", "-N1", "-n1", "-J", name, *_gpulaunch(), "run", "--gpus", "2",
                         "--no-tracking", str(script)],
                        env=_job_env(slurm, FAIL_RANK="1"), cwd=tmp_path)
    assert p.returncode != 0, p.stdout
    assert "gpulaunch: rank 1 raised ValueError: boom on rank 1" in p.stdout, p.stdout
    assert "task 0: Exited with exit code 1" in p.stdout, p.stdout    # srun's own report
    assert _job_state(slurm, name)[1] == "FAILED"
    assert_no_survivors(latest_run_dir(gpulaunch_home))
    assert slurm.leftovers_of(step) == []


def test_sbatch_wait_batch_script_with_srun(slurm, tmp_path, gpulaunch_home):
    script = tmp_path / "allreduce.py"
    script.write_text(SCRIPT)
    out = tmp_path / "job.out"
    name = f"gl-{uuid.uuid4().hex[:8]}"
    batch = tmp_path / "job.sh"
    batch.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --job-name={name}
        #SBATCH --nodes=1
        #SBATCH --ntasks-per-node=1
        #SBATCH --output={out}
        export PYTHONPATH={ROOT / "src"}
        srun {" ".join(_gpulaunch())} run --gpus 2 --no-tracking {script}
        """))
    p, step = slurm.job(["sbatch", "--wait", "--export=ALL", str(batch)], env=_job_env(slurm),
                        cwd=tmp_path)
    text = out.read_text() if out.exists() else "(no output file)"
    assert p.returncode == 0, p.stdout + text + "\n" + slurm.log_tail()
    job = SlurmCluster.job_id(p.stdout)
    assert _job_state(slurm, name) == (job, "COMPLETED")
    assert _rank_lines(text) == [
        f"[rank {r}] rank {r} world 2 sum 3.0 job {job} run_id gpulaunch-{job} "
        f"host {slurm.host}" for r in (0, 1)], text
    assert_no_survivors(latest_run_dir(gpulaunch_home))
    assert slurm.leftovers_of(step) == []


def test_scancel_of_a_running_step_stops_every_rank(slurm, tmp_path, gpulaunch_home):
    """What a cluster does on a time limit or preemption: slurmstepd sends SIGTERM to the
    step's processes. gpulaunch's agent records the stop and nothing of the run survives."""
    from gpulaunch.common.rundir import RunDir
    ready = tmp_path / "ready"
    ready.mkdir()
    script = tmp_path / "sleeps.py"
    script.write_text(textwrap.dedent("""
        import os, time, torch.distributed as dist
        dist.init_process_group("gloo")
        open(os.path.join(os.environ["READY_DIR"], f"rank{dist.get_rank()}"), "w").close()
        time.sleep(120)
    """))
    name = f"gl-{uuid.uuid4().hex[:8]}"
    step = uuid.uuid4().hex
    env = _job_env(slurm, READY_DIR=str(ready), GPULAUNCH_SLURM_STEP=step)
    p = subprocess.Popen(["srun", "-N1", "-n1", "-J", name, *_gpulaunch(), "run", "--gpus",
                          "2", "--no-tracking", str(script)], env=env, cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(list(ready.iterdir())) < 2:
            assert p.poll() is None, p.communicate()[0]
            assert time.monotonic() < deadline, "the ranks never came up"
            time.sleep(0.2)
        job, state = _job_state(slurm, name, final=False)
        assert state == "RUNNING"
        slurm.cmd(["scancel", job], check=True)
        out, _ = p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0, out
    assert f"STEP {job}.0 ON {slurm.host} CANCELLED" in out, out
    assert _job_state(slurm, name) == (job, "CANCELLED")
    run_dir = latest_run_dir(gpulaunch_home)
    status = RunDir(run_dir).status()
    assert status.state.terminal and status.state != "SUCCEEDED", status
    assert_no_survivors(run_dir)
    assert slurm.leftovers_of(step) == []
