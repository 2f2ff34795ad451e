"""Tracking off the call's path: a finished call's MLflow end (uploads, plot, final status)
waits while another call of the process runs, for a bounded time; a warm call's system samples
go to the caller instead of MLflow while the call runs. Real ranks, a real sqlite store."""

from __future__ import annotations

import os
import time

import pytest

mlflow = pytest.importorskip("mlflow")

from mlflow.tracking import MlflowClient  # noqa: E402

import gpulaunch.tracking  # noqa: E402
from gpulaunch import distributed, shutdown  # noqa: E402
from gpulaunch.tracking import callback  # noqa: E402


@pytest.fixture
def store(monkeypatch, tmp_path, gpulaunch_home):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("GPULAUNCH_TRACKING", "1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "offpath")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    yield MlflowClient(uri)
    gpulaunch.tracking.flush(timeout=120)
    shutdown()


def _wait_for(path, limit=300.0):
    deadline = time.monotonic() + limit
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return os.path.exists(path)


def _one():
    return 1


@pytest.mark.parametrize("defer_max, ends_during_the_call", [(600.0, False), (1.0, True)])
def test_a_finished_calls_end_waits_while_another_call_runs(store, monkeypatch, tmp_path,
                                                            defer_max, ends_during_the_call):
    monkeypatch.setattr(callback, "END_DEFER_MAX_S", defer_max)
    flag = str(tmp_path / "go")
    long_call = distributed(gpus=1, stream_logs="none", timeout=300)(_wait_for).submit(flag)
    short = distributed(gpus=1, stream_logs="none")(_one).submit()
    assert short.result(timeout=300) == [1]
    assert long_call.status == "RUNNING"
    if ends_during_the_call:          # waited its bound, then ended beside the running call
        assert gpulaunch.tracking.flush(timeout=120)
        assert store.get_run(short.mlflow_run_id).info.status == "FINISHED"
    else:                             # still waiting for the running call
        assert not gpulaunch.tracking.flush(timeout=3)
        assert store.get_run(short.mlflow_run_id).info.status == "RUNNING"
    open(flag, "w").close()
    assert long_call.result(timeout=300) == [True]
    assert gpulaunch.tracking.flush(timeout=120)
    for handle in (short, long_call):
        assert store.get_run(handle.mlflow_run_id).info.status == "FINISHED"


def _rank_env():
    return os.environ.get("GPULAUNCH_MLFLOW_RUN_ID")


def test_warm_calls_are_tracked_like_cold_ones(store):
    """Each warm call is its own FINISHED run; the ranks see its id; its start and end system
    samples reach the run through the caller."""
    fn = distributed(gpus=2, keep_alive=60, stream_logs="none")(_rank_env)
    handles, seen = [], []
    for _ in range(3):                      # the first starts the pool, the others are warm
        handles.append(fn.submit())
        seen.append(handles[-1].result(timeout=300))
    assert gpulaunch.tracking.flush(timeout=120)
    ids = [h.mlflow_run_id for h in handles]
    assert len(set(ids)) == 3 and seen == [[i, i] for i in ids]
    for run_id in ids:
        assert store.get_run(run_id).info.status == "FINISHED"
        cpu = store.get_metric_history(run_id, "system/node_0/cpu_utilization_percentage")
        steps = sorted(m.step for m in cpu)
        # a start and an end sample, the cold call's too; a call that outlasts the sampling
        # interval (a loaded host) also has the periodic ones between: steps 0, 1, ... without
        # a gap. A warm call over before the sampler thread ran still has both (CI once saw
        # step 0 alone: tests/tracking/test_system_handoff.py)
        assert len(steps) >= 2 and steps == list(range(len(steps))), steps
