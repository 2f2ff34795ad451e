"""A job on the GPUs: the FSDP fine-tune recipe (recipes/jobs/fsdp_finetune) submitted with
``gpulaunch job run`` on every GPU of the host, bf16, detached; it succeeds, its attempt is an
MLflow run nested under the job's run and holds the GPUs' NVML system metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .helpers import require

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def _gl(*args, env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpulaunch.cli", *args], env=env, text=True,
                          capture_output=True, timeout=120, stdin=subprocess.DEVNULL)


@pytest.mark.timeout(600)
def test_fsdp_recipe_job_on_every_gpu_with_nested_mlflow_run(gpu, record, tmp_path):
    require("mlflow", "mlflow-skinny + SQLAlchemy + alembic and their dependencies")
    require("pynvml", "nvidia-ml-py")
    from mlflow.tracking import MlflowClient
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = dict(os.environ, GPULAUNCH_TRACKING="1", MLFLOW_TRACKING_URI=uri,
               MLFLOW_DISABLE_TELEMETRY="true", GPULAUNCH_SYSTEM_METRICS_INTERVAL="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    env.pop("MLFLOW_RUN_ID", None)
    spec = ROOT / "recipes" / "jobs" / "fsdp_finetune" / "job.yaml"
    t0 = time.perf_counter()
    p = _gl("job", "run", str(spec), "--override", f"compute.gpus={gpu.count}",
            "--override", 'command.args=["--steps", "200", "--mixed-precision", "bf16", '
                          '"--dim", "1024", "--layers", "8", "--seq-len", "512"]', "--json",
            env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    job_id = json.loads(p.stdout)["job_id"]
    deadline = time.monotonic() + 540
    while True:
        d = json.loads(_gl("job", "get", job_id, "--json", env=env).stdout)
        if d["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") or time.monotonic() > deadline:
            break
        time.sleep(2)
    logs = _gl("job", "logs", job_id, env=env).stdout
    assert d["state"] == "SUCCEEDED", (d, logs[-3000:])
    assert "[rank 0] step 200 loss" in logs, logs[-3000:]
    client = MlflowClient(uri)
    attempt_run = d["attempts"][0]["mlflow_run_id"]
    run = client.get_run(attempt_run)
    assert run.data.tags["mlflow.parentRunId"] == d["mlflow_run_id"]
    util = [m.value for m in client.get_metric_history(
        attempt_run, "system/node_0/gpu_0_utilization_percentage")]
    assert util and max(util) > 0, util
    record(job_seconds=round(time.perf_counter() - t0, 1), gpus=gpu.count,
           last_loss_line=[x for x in logs.splitlines() if "step 200 loss" in x][-1])
