"""Unit tests of what crosses process boundaries and of the root-cause rules (pure: no
process, no file; seconds). The end-to-end fault matrix is in tests/faults/test_faults.py."""

from __future__ import annotations

import pickle
import time

import pytest

from gpulaunch import errors
from gpulaunch.caller.outcome import HangReport, RankFailure, RunOutcome, settle
from gpulaunch.common.records import (
    AttemptRecord,
    Entry,
    LaunchRecord,
    LaunchSpec,
    NodeStatus,
    RankError,
    RankExit,
    RunState,
    StopReason,
)
from gpulaunch.hardware.catalog import GPUType

pytestmark = pytest.mark.unit


def _error(rank, exc, *, collateral=False, at=0.0) -> RankError:
    return RankError(type=f"builtins.{type(exc).__name__}", message=str(exc), traceback="tb\n",
                     rank=rank, host="h", exception=pickle.dumps(exc), collateral=collateral,
                     time=at)


def _failed(*failures, **kw) -> RunOutcome:
    return RunOutcome(run_dir="/runs/x", world_size=4, state=RunState.FAILED,
                      failures=tuple(failures), **kw)


def test_records_survive_a_json_round_trip():
    spec = LaunchSpec(nproc_per_node=8, device="cuda", gpu_type=GPUType.H200, timeout=None,
                      stream_logs=(0, 2), env=(("A", "1"),))
    record = LaunchRecord(run_id="r1", label="train", spec=spec, entry=Entry("script", ("a.py",)),
                          extensions={"tracking": {"run_id": "m1"}})
    assert LaunchRecord.from_json(record.to_json()) == record
    status = NodeStatus(state=RunState.FAILED, pids={0: 11, 1: 12}, history=[
        AttemptRecord(attempt=0, ended=1.5, failures={1: RankExit(rank=1, exitcode=-9)})])
    back = NodeStatus.from_json(status.to_json())
    assert back == status and back.state is RunState.FAILED and back.pids[1] == 12
    assert RunState("FAILED").terminal and not RunState.RUNNING.terminal


def test_the_root_cause_is_the_first_rank_that_failed_on_its_own_account():
    own = RankFailure(rank=2, exit_code=1, error=_error(2, ValueError("bad batch"), at=5.0))
    collateral = RankFailure(rank=0, exit_code=1, error=_error(
        0, RuntimeError("Connection closed by peer"), collateral=True, at=1.0))
    crashed = RankFailure(rank=3, exit_code=-9, error=None)
    with pytest.raises(ValueError, match="bad batch") as info:
        settle(_failed(collateral, crashed, own))
    assert info.value.rank == 2 and info.value.run_dir == "/runs/x"
    assert "Also failed" in str(info.value.__cause__) and "rank 0" in str(info.value.__cause__)


def test_a_crash_without_exception_beats_collateral_errors():
    collateral = RankFailure(rank=0, exit_code=1, error=_error(
        0, RuntimeError("Connection closed by peer"), collateral=True))
    killed = RankFailure(rank=3, exit_code=-9, error=None, log_tail="step 7")
    with pytest.raises(errors.WorkerCrashError, match="SIGKILL") as info:
        settle(_failed(collateral, killed, oom_confirmed=True))
    assert info.value.rank == 3 and info.value.exit_code == -9
    assert "out-of-memory killer" in str(info.value) and "step 7" in str(info.value)


def test_same_error_at_nearly_the_same_moment_names_the_lowest_rank():
    now = time.time()
    fs = [RankFailure(rank=r, exit_code=1, error=_error(r, KeyError("x"), at=now + 0.01 * (3 - r)))
          for r in range(4)]
    with pytest.raises(KeyError) as info:
        settle(_failed(*fs))
    assert info.value.rank == 0


def test_an_exception_class_the_caller_cannot_import_arrives_as_remote_error():
    err = RankError(type="mypkg.TrainingDiverged", message="loss is nan", traceback="tb",
                    rank=1, host="h", exception=b"not a pickle")
    with pytest.raises(errors.RemoteError, match="TrainingDiverged: loss is nan") as info:
        settle(_failed(RankFailure(rank=1, exit_code=1, error=err)))
    assert info.value.remote_type == "mypkg.TrainingDiverged"


def test_caller_verdicts_come_before_rank_failures():
    rank_failure = RankFailure(rank=0, exit_code=-15, error=None)
    with pytest.raises(errors.RunTimeoutError, match="timeout=5 s"):
        settle(_failed(rank_failure, reason=StopReason.TIMEOUT, timeout=5))
    with pytest.raises(errors.RunCancelledError):
        settle(_failed(rank_failure, reason=StopReason.CANCELLED))
    hang = HangReport(detected_by=1, stuck_for=30.0, where="all_reduce", stacks={0: "a", 1: "b"})
    with pytest.raises(errors.HangError, match="rank 1 made no progress") as info:
        settle(_failed(rank_failure, hang=hang))
    assert info.value.stacks == {0: "a", 1: "b"}


def test_multi_node_errors_carry_the_node():
    f = RankFailure(rank=13, exit_code=1, error=_error(13, ValueError("x")))
    with pytest.raises(ValueError) as info:
        settle(_failed(f, nproc_per_node=8))
    assert info.value.node_rank == 1


def test_success_loads_the_results_only_then():
    ok = RunOutcome(run_dir="/r", world_size=2, state=RunState.SUCCEEDED,
                    load_results=lambda: ["a", "b"])
    assert settle(ok) == ["a", "b"]
