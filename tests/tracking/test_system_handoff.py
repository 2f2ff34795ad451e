"""A node's system samples reach its MLflow run even when its sampler thread cannot log them:
the thread had not run yet when the call ended, the store refused the last sample, or the
store did not answer within ``stop()``'s wait. What the thread did not log goes to the caller
through the handoff file, and the caller logs it at the run's end. A real sqlite store, a
real sampler thread; the store fails for real (a deleted run, a locked database)."""

from __future__ import annotations

import sqlite3
import time
import types

import pytest

mlflow = pytest.importorskip("mlflow")

from mlflow.tracking import MlflowClient  # noqa: E402

from gpulaunch.common.rundir import read_json  # noqa: E402
from gpulaunch.tracking.run_end import RunEnd  # noqa: E402
from gpulaunch.tracking.system import SystemMetricsLogger  # noqa: E402

CPU = "system/node_0/cpu_utilization_percentage"


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    """One sqlite store for the module (a fresh store's schema migration takes seconds)."""
    path = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    client = MlflowClient(f"sqlite:///{path}")
    client.create_experiment("handoff")
    return path


@pytest.fixture
def run(db, monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    client = MlflowClient(f"sqlite:///{db}")
    run_id = client.create_run(client.get_experiment_by_name("handoff").experiment_id).info.run_id
    return types.SimpleNamespace(client=client, id=run_id, uri=f"sqlite:///{db}",
                                 handoff=tmp_path / "system_metrics.node0.json", path=tmp_path)


def _logger(run, interval: float) -> SystemMetricsLogger:
    return SystemMetricsLogger(run.id, run.uri, 0, interval, handoff=run.handoff)


def _caller_logs(run) -> None:
    """What the caller does at the run's end with the handoff files of its run directory."""
    RunEnd._log_handed_off_system_metrics(types.SimpleNamespace(run=run), run.client, run.id)


def _steps(run) -> list[int]:
    return sorted(m.step for m in run.client.get_metric_history(run.id, CPU))


def _wait_for_start_sample(logger: SystemMetricsLogger) -> None:
    deadline = time.monotonic() + 120
    while logger.samples < 1 and time.monotonic() < deadline:     # logged by the thread
        time.sleep(0.05)
    assert logger.samples >= 1


def test_a_call_over_before_the_thread_sampled_still_has_both_ends(run):
    """A warm call takes milliseconds; on a loaded host the thread may not have taken its
    start sample when ``stop()`` comes (CI saw a warm call's run with step 0 alone)."""
    for _ in range(5):
        logger = _logger(run, 5.0).start()
        logger.stop()                        # at once: the thread has rarely sampled yet
        data = read_json(run.handoff)
        assert [s["step"] for s in data["samples"]] == [0, 1]
    _caller_logs(run)
    assert _steps(run) == [0, 1]


def test_an_end_sample_the_store_refused_goes_to_the_caller(run):
    logger = _logger(run, 3.0).start()       # its client made after 3 s: logs step 0 itself
    _wait_for_start_sample(logger)
    run.client.delete_run(run.id)            # the store refuses the thread's next batch
    stopped_ms = time.time() * 1000
    logger.stop(timeout=120)
    run.client.restore_run(run.id)
    assert _steps(run) == [0]
    _caller_logs(run)
    steps = _steps(run)
    assert len(steps) >= 2 and steps == list(range(len(steps))), steps
    last = max(run.client.get_metric_history(run.id, CPU), key=lambda m: m.step)
    assert last.timestamp >= stopped_ms - 1       # the end sample, taken at stop()


def test_an_end_sample_the_store_held_past_the_wait_goes_to_the_caller(run, db):
    logger = _logger(run, 3.0).start()
    _wait_for_start_sample(logger)
    lock = sqlite3.connect(db, isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")           # another writer holds the database
    try:
        stopped_ms = time.time() * 1000
        logger.stop(timeout=1)                # the thread's batch waits on the lock
        data = read_json(run.handoff)
        assert data and data["samples"][-1]["timestamp"] >= stopped_ms - 1
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    _caller_logs(run)                         # the thread may land its copy too: kept once
    steps = _steps(run)
    assert len(steps) >= 2 and steps == list(range(len(steps))), steps
