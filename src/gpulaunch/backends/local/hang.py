"""What happens when a rank's watchdog reports itself stuck (``hang_timeout``), one routine for
the node agent's cold ranks (``agent.py``) and the warm pool's (``pool.py``): every local rank
dumps its Python stacks (SIGUSR1 -> faulthandler -> ``rank<r>.stacks``) and, on CUDA, its NCCL
flight record (``dump_request`` -> each rank's watchdog thread -> ``rank<r>.nccl_trace.pkl``);
then ``hang.json`` says who detected what. Tearing the ranks down is the caller's of this
routine (a node agent in a multi-node job waits for the other nodes' stacks first)."""

from __future__ import annotations

import signal
import time

from ...common import constants, procutil
from ...common.records import HangRecord, StuckReport
from ...common.rundir import RunDir, read_json, write_json_atomic
from ...rank.watchdog import DUMP_REQUEST

TRACE_WAIT_S = 5.0          # how long the NCCL traces may take to land after the request


def stuck_report(run: RunDir, attempt: int) -> StuckReport | None:
    """The first ``rank<r>.stuck`` of this attempt, or None when no rank reported a stall."""
    stuck = sorted(run.attempt_dir(attempt).glob("rank*.stuck"))
    if not stuck:
        return None
    return StuckReport.from_data(read_json(stuck[0], {}) or {
        "rank": -1, "stuck_for": 0, "since_unix": 0, "where": ""})


def record_hang(run: RunDir, attempt: int, report: StuckReport, pids: list[int], *,
                device: str, node_rank: int = 0) -> HangRecord:
    """Have every rank in ``pids`` dump its stacks (and NCCL traces on CUDA); write hang.json."""
    if device == "cuda":
        # Each rank's watchdog thread dumps its flight record (a Python thread: it runs while
        # the main thread waits inside CUDA or NCCL, where a signal handler cannot).
        (run.attempt_dir(attempt) / DUMP_REQUEST).touch()
    procutil.kill_pids(pids, signal.SIGUSR1)      # faulthandler: dump every thread's stack
    time.sleep(constants.STACK_DUMP_WAIT_S)
    if device == "cuda":
        wait_for_traces(run, attempt, len(pids))
    hang = HangRecord(detected_by=report.rank, attempt=attempt, stuck_for=report.stuck_for,
                      where=report.where, time=time.time(), node_rank=node_rank)
    write_json_atomic(run.hang_json, hang.to_data())
    return hang


def wait_for_traces(run: RunDir, attempt: int, ranks: int, timeout: float = TRACE_WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(list(run.attempt_dir(attempt).glob("rank*.nccl_trace.pkl"))) >= ranks:
            return
        time.sleep(0.1)
