"""Retries and environments of local jobs: every attempt's cause recorded, each attempt an
MLflow run nested under the job's run (a real MLflow file store); requirements built into a
venv once per hash, and a failing install failing the job before its first attempt."""

from __future__ import annotations

import pytest
from jobhelp import get, gl, wait_state, wheel, write_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_failing_job_retries_with_causes_and_nested_mlflow_runs(tmp_path, gpulaunch_home,
                                                                monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = tmp_path / "mlruns"
    spec = write_job(tmp_path, f"""\
        environment:
          env: {{FAIL_RANK: "1"}}
        retry: {{max_retries: 2, backoff: 0.2}}
        tracking:
          tracking_uri: file://{store}
          experiment: jobs-retries
          system_metrics: false
        """)
    env = {"GPULAUNCH_TRACKING": "", "MLFLOW_ALLOW_FILE_STORE": "true"}
    job_id = gl("job", "run", spec, env=env).stdout.strip()
    d = wait_state(job_id, timeout=300)
    assert d["state"] == "FAILED", d
    assert [a["attempt"] for a in d["attempts"]] == [1, 2, 3]
    for a in d["attempts"]:
        assert a["state"] == "FAILED" and a["cause"] == "rank 1 raised ValueError: boom on rank 1"
    text = gl("job", "get", job_id).stdout
    assert text.count("FAILED - rank 1 raised ValueError: boom on rank 1") == 3, text

    from mlflow.tracking import MlflowClient
    client = MlflowClient(f"file://{store}")
    exp = client.get_experiment_by_name("jobs-retries")
    job_run = client.get_run(d["mlflow_run_id"])
    assert job_run.data.tags["gpulaunch.job_id"] == job_id
    assert job_run.info.status == "FAILED"
    children = client.search_runs([exp.experiment_id],
                                  f"tags.mlflow.parentRunId = '{job_run.info.run_id}'")
    assert sorted(r.data.tags["gpulaunch.job_attempt"] for r in children) == ["1", "2", "3"]
    for r in children:
        assert r.info.status == "FAILED"
        assert r.data.tags["gpulaunch.root_cause"] == "rank 1 raised ValueError: boom on rank 1"
        assert r.data.params["gpulaunch.world_size"] == "2"     # the launch's own run
    assert {r.info.run_id for r in children} == {a["mlflow_run_id"] for a in d["attempts"]}


def test_requirements_build_a_venv_once_and_a_bad_one_fails_early(tmp_path, gpulaunch_home):
    whl = wheel(tmp_path, "jobdep", "1.2.3", "VALUE = 'from the job venv'\n")
    spec = write_job(tmp_path, f"environment:\n  requirements: ['{whl}']\n")
    code = tmp_path / "code" / "train.py"
    code.write_text("import jobdep, sys\nprint(jobdep.VALUE, sys.prefix, flush=True)\n")
    offline = {"PIP_NO_INDEX": "1"}
    first = gl("job", "run", spec, env=offline).stdout.strip()
    d = wait_state(first)
    assert d["state"] == "SUCCEEDED", d
    logs = gl("job", "logs", first, "--rank", "0").stdout
    assert "from the job venv" in logs and str(gpulaunch_home / "envs") in logs, logs
    sup = (gpulaunch_home / "jobs" / first / "supervisor.log").read_text()
    assert "building the job's environment" in sup
    second = gl("job", "run", spec, env=offline).stdout.strip()
    assert wait_state(second)["state"] == "SUCCEEDED"
    sup2 = (gpulaunch_home / "jobs" / second / "supervisor.log").read_text()
    assert "building the job's environment" not in sup2, sup2   # the cached venv was used

    bad = write_job(tmp_path, "environment:\n  requirements: ['gpulaunch-no-such-dep==9.9']\n",
                    name="bad")
    job_id = gl("job", "run", bad, env=offline).stdout.strip()
    d = wait_state(job_id)
    assert d["state"] == "FAILED" and len(d["attempts"]) == 1, d
    cause = d["attempts"][0]["cause"]
    assert cause.startswith("environment: pip could not install the job's requirements"), cause
    assert "gpulaunch-no-such-dep==9.9" in cause, cause          # pip's own words
    assert "run_dir" not in d["attempts"][0]                     # no rank ever started
    assert get(job_id)["cause"] == cause
