"""Jobs on a real local Ray cluster (``ray start --head`` with its job server): each attempt is
a Ray job submitted through Ray's job API, with the code snapshot as working_dir and the
requirements as its pip runtime environment; logs come back through the API; cancel is
stop_job. The cluster is this module's own (its own session, socket folder and ports), ended
by signalling its process group, never with ``ray stop`` (which would end every Ray here)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from conftest import PY, python_env
from jobhelp import alive, get, gl, wait_for, wait_state, wheel, write_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sweep_stale_tmpdirs() -> None:
    """Remove the temp folders of earlier runs of this module that were killed before their
    teardown (their pid is gone). Each holds a copy of the test virtualenv per pip runtime
    environment (Ray clones the driver's virtualenv: about 7 GB here), so a few of them fill
    the disk, and then every pip environment fails with ENOSPC."""
    for d in Path("/tmp").glob("rj-*"):
        pid = d.name[3:]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def _raylet_error(tmpdir: str) -> str:
    for log in sorted(Path(tmpdir).glob("ray/session_2*/logs/raylet.out"))[-1:]:
        lines = [x for x in log.read_text(errors="replace").splitlines() if "Check failed" in x]
        if lines:
            return "raylet: " + lines[-1].split("Check failed:")[-1].strip()[:300]
    return "no raylet error logged"


def _unstartable(why: str):
    """A head whose dashboard agent never came up: on a 2-core machine under a load of 15+
    the raylet gives up waiting for the agent's port file after about a minute."""
    if os.environ.get("GPULAUNCH_REQUIRE_RAY_JOBS") == "1":
        pytest.fail(f"no Ray job server: {why}")
    pytest.skip(f"no Ray job server here: {why} (GPULAUNCH_REQUIRE_RAY_JOBS=1 makes this fail)")


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    pytest.importorskip("ray.job_submission")
    base = tmp_path_factory.mktemp("rayjobs")
    _sweep_stale_tmpdirs()
    tmpdir = f"/tmp/rj-{os.getpid()}"
    port = _free_port()
    env = python_env({"RAY_TMPDIR": tmpdir, "RAY_AUTH_MODE": "disabled", "PIP_NO_INDEX": "1",
                      # a loaded 2-core machine starts the dashboard agent slowly
                      "RAY_agent_register_timeout_ms": "600000",
                      "GPULAUNCH_HOME": str(base / "cluster-home"), "GPULAUNCH_QUIET": "1",
                      "GPULAUNCH_FORCE_CPU": "1", "GPULAUNCH_TRACKING": "0",
                      "PATH": os.pathsep.join([str(Path(PY).parent),
                                               os.environ.get("PATH", "")])})
    head = subprocess.Popen([str(Path(PY).parent / "ray"), "start", "--head", "--block",
                             "--port=0", f"--dashboard-port={port}", "--num-cpus=6",
                             "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                             "--disable-usage-stats",
                             # fixed ports: with port 0 the raylet waits ~60 s at most for the
                             # agents to write theirs, which a loaded 2-core machine misses
                             *(f"--{flag}={_free_port()}" for flag in (
                                 "metrics-export-port", "dashboard-agent-grpc-port",
                                 "dashboard-agent-listen-port", "runtime-env-agent-port"))],
                            env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    address = f"http://127.0.0.1:{port}"
    try:
        from ray.job_submission import JobSubmissionClient

        def up():
            assert head.poll() is None, "ray start exited"
            try:
                c = JobSubmissionClient(address)
                c.list_jobs()
                return c
            except Exception:  # noqa: BLE001 - not up yet
                return None
        try:
            client = wait_for("the Ray job server", up, timeout=300, every=2)
        except AssertionError as e:
            _unstartable(f"{e} ({_raylet_error(tmpdir)})")
        # the job server takes jobs once a dashboard agent registered: wait for a real one
        def submitted():
            try:
                return client.submit_job(entrypoint="python -c 'print(1)'")
            except Exception:  # noqa: BLE001 - "No available agent ... try again later", or
                return None    # the dashboard still restarting its modules
        try:
            sid = wait_for("a dashboard agent taking jobs", submitted, timeout=300, every=2)
        except AssertionError as e:
            _unstartable(f"{e} ({_raylet_error(tmpdir)})")
        wait_for("a first Ray job", lambda: str(client.get_job_status(sid)).endswith(
            ("SUCCEEDED", "FAILED")), timeout=300, every=1)
        yield address
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        left = []
        for p in psutil.process_iter():      # this cluster's processes only (its socket dir)
            try:
                if any(tmpdir in a for a in p.cmdline()):
                    p.kill()
                    left.append(p)
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=30)
        shutil.rmtree(tmpdir, ignore_errors=True)   # its runtime envs: gigabytes each


def _spec(tmp_path, address: str, extra: str = "", name: str = "t"):
    spec = write_job(tmp_path, name=name)
    text = spec.read_text().replace(
        "compute:\n  gpus: 2\n", f"compute:\n  where: ray\n  gpus: 2\n  ray:\n"
                                 f"    address: {address}\n")
    spec.write_text(text + extra)
    return spec


def _why(d: dict) -> str:
    """What a failed job's attempts say, for an assertion message (pytest cuts the dict)."""
    return json.dumps([(a.get("state"), a.get("cause")) for a in d.get("attempts", [])])[-4000:]


def test_ray_job_installs_requirements_runs_and_logs(ray_head, tmp_path, gpulaunch_home):
    whl = wheel(tmp_path, "rayjobdep", "0.1", "VALUE = 'installed by the Ray job'\n")
    (tmp_path / "bad").mkdir()
    bad = _spec(tmp_path / "bad", ray_head,
                "environment:\n  requirements: ['gpulaunch-no-such-dep==9.9']\n", name="bad")
    bad_id = gl("job", "run", bad).stdout.strip()
    spec = _spec(tmp_path, ray_head, f"environment:\n  requirements: ['{whl}']\n")
    (tmp_path / "code" / "train.py").write_text(
        "import rayjobdep\n" + (tmp_path / "code" / "train.py").read_text()
        .replace('print(f"rank {r} done", flush=True)',
                 'print(f"rank {r} done", rayjobdep.VALUE, flush=True)'))
    job_id = gl("job", "run", spec).stdout.strip()
    d = wait_state(job_id, timeout=500)
    assert d["state"] == "SUCCEEDED", _why(d)
    assert d["attempts"][0]["ray_submission_id"] == f"{job_id}-a1"
    logs = gl("job", "logs", job_id).stdout
    assert "[node 0 rank 1] rank 1 done installed by the Ray job" in logs, logs
    assert gl("job", "logs", job_id, "--rank", "0").stdout.splitlines() == \
        ["rank 0 sum 3.0", "rank 0 done installed by the Ray job"]

    d = wait_state(bad_id, timeout=300)
    assert d["state"] == "FAILED", _why(d)
    cause = d["attempts"][0]["cause"]
    assert f"Ray job {bad_id}-a1 ended FAILED" in cause, cause
    assert "gpulaunch-no-such-dep==9.9" in cause, cause               # pip's words, via Ray
    assert len(cause) < 3200, len(cause)                              # bounded; whole in the log
    assert "gpulaunch-no-such-dep==9.9" in gl("job", "logs", bad_id).stdout


def test_ray_cancel_stops_the_ray_job_and_its_ranks(ray_head, tmp_path, gpulaunch_home):
    go = tmp_path / "never"
    spec = _spec(tmp_path, ray_head, f"environment:\n  env: {{WAIT_FILE: '{go}'}}\n")
    job_id = gl("job", "run", spec).stdout.strip()
    files = [tmp_path / f"never.rank{r}" for r in (0, 1)]
    wait_for("both ranks up", lambda: all(f.exists() and f.read_text() for f in files),
             timeout=400)
    pids = {int(f.read_text()) for f in files}
    assert len(alive(pids)) == 2
    out = json.loads(gl("job", "cancel", job_id, "--json").stdout)
    assert out["state"] == "CANCELLED", out
    from ray.job_submission import JobSubmissionClient
    status = JobSubmissionClient(ray_head).get_job_status(f"{job_id}-a1")
    assert str(status).endswith("STOPPED"), status
    assert get(job_id)["attempts"][0]["state"] == "CANCELLED"
    deadline = time.monotonic() + 60
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(pids), f"ranks of a cancelled Ray job survived: {alive(pids)}"
    sup = json.loads((gpulaunch_home / "jobs" / job_id / "job.json").read_text())
    assert not alive([sup["supervisor_pid"]])
