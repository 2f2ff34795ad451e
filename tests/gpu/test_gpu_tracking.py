"""Tracking with MLflow present: a launch on the GPUs is one MLflow run (a sqlite store, no
server) that holds the node's GPU system metrics, read through NVML by the node agent while the
ranks work: utilisation, memory and power per GPU, several samples each."""

from __future__ import annotations

import time

import pytest

from gpulaunch import runtime as rt

from .helpers import require

pytestmark = pytest.mark.gpu
HOLD_BYTES = 2 << 30          # each rank holds 2 GiB: the memory series must show it


def burn(seconds: float) -> int:
    """bf16 matmuls for ``seconds`` on this rank's GPU; rank 0 logs a metric of its own."""
    import mlflow
    import torch
    dev = rt.init()
    hold = torch.ones(HOLD_BYTES, dtype=torch.uint8, device=dev)
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    rounds, end = 0, time.time() + seconds
    while time.time() < end:
        for _ in range(20):
            a = (a @ a.T).clamp_(-1, 1)
        torch.cuda.synchronize(dev)
        rounds += 1
    if rt.is_main():
        mlflow.log_metric("matmul_rounds", rounds)
    return rounds + int(hold[0].item())


@pytest.mark.timeout(150)
def test_a_tracked_gpu_launch_records_nvml_system_metrics(gpu, record, tmp_path, monkeypatch):
    require("mlflow", "mlflow-skinny + SQLAlchemy + alembic and their dependencies")
    require("pynvml", "nvidia-ml-py")
    from mlflow.tracking import MlflowClient

    from gpulaunch import distributed
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for k, v in {"GPULAUNCH_TRACKING": "1", "MLFLOW_TRACKING_URI": uri,
                 "MLFLOW_EXPERIMENT_NAME": "gpu-suite", "MLFLOW_DISABLE_TELEMETRY": "true",
                 "GPULAUNCH_SYSTEM_METRICS_INTERVAL": "1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    handle = distributed(timeout=120, stream_logs="none")(burn).submit(8.0)
    assert all(r >= 1 for r in handle.result(timeout=140))
    import gpulaunch.tracking
    assert gpulaunch.tracking.flush(timeout=120)   # the run ends in the background
    run_id = handle.mlflow_run_id
    assert run_id, "the launch made no MLflow run"
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED", run.info.status
    assert run.data.metrics.get("matmul_rounds", 0) >= 1, sorted(run.data.metrics)
    seen = {}
    for i in range(gpu.count):
        for key in ("utilization_percentage", "memory_usage_megabytes", "power_usage_watts"):
            name = f"system/node_0/gpu_{i}_{key}"
            values = [m.value for m in client.get_metric_history(run_id, name)]
            assert len(values) >= 3, (name, values, sorted(run.data.metrics))
            seen[name] = {"points": len(values), "max": max(values)}
        assert seen[f"system/node_0/gpu_{i}_utilization_percentage"]["max"] > 0, seen
        assert seen[f"system/node_0/gpu_{i}_memory_usage_megabytes"]["max"] >= \
            HOLD_BYTES / 1e6, seen
        assert seen[f"system/node_0/gpu_{i}_power_usage_watts"]["max"] > 0, seen
    record(metrics=seen)
