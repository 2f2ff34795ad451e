"""How a finished run ends for the caller: the list of results, or the one error that explains it.

``RunOutcome`` is what a backend reports (typed; the local and the Ray backend build the same
record, ``caller.collect``), and ``settle()`` applies the rules to it. Pure: no file, no
process; results are loaded through the outcome's own loader, only on success.

The error names the root cause: the rank that failed first for a reason of its own. A rank that
only failed because a peer vanished under it (gloo "Connection closed by peer", an aborted NCCL
communicator) is a consequence, never the cause, unless nothing else failed.
"""

from __future__ import annotations

import dataclasses
import pickle
import signal
from typing import Callable

from .. import errors
from ..common.procutil import describe_exit
from ..common.records import NodeState, PeerFailure, RankError, StopReason


@dataclasses.dataclass(frozen=True)
class RankFailure:
    """One rank's failure in the final attempt, with what is known about it."""

    rank: int
    exit_code: int | None
    error: RankError | None
    host: str = "?"
    log_tail: str = ""

    @property
    def priority(self) -> int:
        """0: raised on its own account; 1: crashed without a Python exception; 2: collateral."""
        if self.error is None:
            return 1
        return 2 if self.error.collateral else 0

    @property
    def time(self) -> float:
        return self.error.time if self.error is not None else float("inf")

    def summary(self) -> str:
        if self.error is not None:
            message = (self.error.message.splitlines() or [""])[0]
            if len(message) > 160:
                message = message[:160] + "..."
            return f"rank {self.rank}: {self.error.type.rsplit('.', 1)[-1]}: {message}"
        return f"rank {self.rank} {describe_exit(self.exit_code)}"


@dataclasses.dataclass(frozen=True)
class HangReport:
    detected_by: int
    stuck_for: float
    where: str
    stacks: dict[int, str]


@dataclasses.dataclass(frozen=True)
class LostNode:
    node_rank: int
    why: str
    description: str              # "Ray node 1a2b..., ip 10.0.0.3, host h1; ranks 4-7"
    host: str | None = None
    first_rank: int = 0


@dataclasses.dataclass(frozen=True)
class RunOutcome:
    """Everything the rules need about a finished run, from either backend."""

    run_dir: str
    world_size: int
    state: NodeState                        # the backend's final state
    reason: StopReason | None = None       # the caller stopped it (timeout / cancel)
    timeout: float | None = None
    attempt: int = 0
    entry_kind: str = "function"           # Entry.kind, or "ray_program" (ray_launch)
    failures: tuple[RankFailure, ...] = ()
    hang: HangReport | None = None
    agent_error: str | None = None
    agent_traceback: str = ""
    agent_log_tail: str = ""
    lost: LostNode | None = None
    rank0_log_tail: str = ""
    oom_confirmed: bool = False
    nproc_per_node: int = 0                # > 0 on multi-node runs: errors get node_rank
    peer_failure: PeerFailure | None = None  # gpulaunch run --nnodes: another node failed
    history: tuple[str, ...] = ()          # "attempt k: <root cause>" of each earlier attempt
    load_results: Callable[[], list] = dataclasses.field(default=lambda: [], compare=False)


def root_cause(failures) -> RankFailure:
    best = min(failures, key=lambda f: (f.priority, f.time, f.rank))
    # Ranks that raise the same error at nearly the same moment: report the lowest rank.
    near = [f for f in failures if f.priority == best.priority and f.time - best.time < 0.5
            and (f.error.type if f.error else None) == (best.error.type if best.error else None)]
    return min(near, key=lambda f: f.rank) if near else best


def signal_hint(exit_code: int, oom_confirmed: bool) -> str:
    sig = -exit_code
    if sig == signal.SIGKILL:
        if oom_confirmed:
            return ("The kernel's out-of-memory killer killed it (the cgroup's oom_kill counter "
                    "went up during the run): the ranks together needed more host RAM than this "
                    "machine or container allows. Load less per rank, use fewer ranks, or shard "
                    "the model (FSDP/ZeRO) instead of replicating it.")
        return ("SIGKILL is what the host's out-of-memory killer sends (check `dmesg` or the "
                "container's memory limit); it is also what `kill -9` sends.")
    if sig == signal.SIGSEGV:
        return ("A segmentation fault in native code (a C/C++/CUDA extension). The Python stack "
                "at the crash, printed by faulthandler, is in the log below.")
    if sig == signal.SIGABRT:
        return "The process aborted (a failed C++ assertion or an uncaught C++ exception)."
    if sig == signal.SIGBUS:
        return "SIGBUS: often an undersized /dev/shm (DataLoader workers in a container)."
    return ""


def _earlier(o: RunOutcome) -> str:
    """The root cause of every earlier attempt of a run with restarts (max_restarts)."""
    if not o.history:
        return ""
    return (f"\nEarlier attempts ({len(o.history)} restart(s) of every rank, all spent): "
            + "; ".join(o.history))


def _indent(text: str, pad: str = "    ") -> str:
    return "\n".join(pad + line for line in text.splitlines())


def settle(o: RunOutcome) -> list:
    """Return the per-rank results of a finished run, or raise the error that explains it."""
    try:
        return _settle(o)
    except BaseException as e:
        if o.history:
            try:
                e.restart_history = list(o.history)
            except Exception:  # noqa: BLE001 - an exception class with slots
                pass
        rank = getattr(e, "rank", None)
        if o.nproc_per_node and isinstance(rank, int) and getattr(e, "node_rank", None) is None:
            try:
                e.node_rank = rank // o.nproc_per_node
            except Exception:  # noqa: BLE001 - an exception class with slots
                pass
        raise


def _settle(o: RunOutcome) -> list:
    run_dir = o.run_dir
    if o.reason is StopReason.TIMEOUT:
        raise errors.RunTimeoutError(
            f"The run exceeded timeout={o.timeout:g} s and was stopped (every rank got SIGTERM, "
            f"then SIGKILL). Raise timeout= (or pass timeout=None) if it needs longer.\n"
            f"Last lines of rank 0:\n{_indent(o.rank0_log_tail)}\nRun directory: {run_dir}",
            rank=None, run_dir=run_dir, log_tail=o.rank0_log_tail)
    if o.reason is StopReason.CANCELLED:
        raise errors.RunCancelledError(f"The run was cancelled; every rank was stopped. "
                                       f"Run directory: {run_dir}", run_dir=run_dir)
    if o.state is NodeState.DISCONNECTED:
        raise errors.LaunchError(
            f"The connection to the Ray cluster ended while the run was going (ray.shutdown() "
            f"was called, or the head node went away). The job's node agents belonged to this "
            f"connection, so Ray stopped them with it. Run directory: {run_dir}", run_dir=run_dir)
    if o.lost is not None:
        others = "; ".join(f.summary() for f in o.failures)
        also = f"\nAfter it, these ranks failed too (a consequence): {others}" if others else ""
        also += _earlier(o)
        raise errors.NodeLostError(
            f"Node {o.lost.node_rank} of the job ({o.lost.description}) was lost: "
            f"{o.lost.why}. Every other node was stopped.{also}\nRun directory: {run_dir}",
            rank=o.lost.first_rank, host=o.lost.host, run_dir=run_dir,
            node_rank=o.lost.node_rank)
    if o.hang is not None:
        h = o.hang
        body = "\n".join(f"--- rank {r} ---\n{_indent(s)}" for r, s in sorted(h.stacks.items()))
        raise errors.HangError(
            f"Hang detected: rank {h.detected_by} made no progress for {h.stuck_for} s "
            f"(hang_timeout). It was waiting at:\n{_indent(h.where.rstrip())}\n"
            f"Every rank was stopped. Python stacks of all ranks at that moment:\n{body}"
            f"{_earlier(o)}\nRun directory: {run_dir}",
            rank=h.detected_by, stacks=dict(h.stacks), run_dir=run_dir)
    if o.state is NodeState.SUCCEEDED:
        return o.load_results()
    if o.state is NodeState.FAILED and o.peer_failure is not None and \
            (not o.failures or root_cause(o.failures).priority == 2):
        _raise_peer_failure(o)
    if o.state is NodeState.FAILED:
        if not o.failures:
            raise errors.LaunchError(f"The run failed but no rank reported a failure. "
                                     f"Run directory: {run_dir}", run_dir=run_dir)
        _raise_rank_failure(o)
    if o.state is NodeState.AGENT_ERROR:
        raise errors.LaunchError(f"gpulaunch's agent failed: {o.agent_error}\n"
                                 f"{o.agent_traceback}Run directory: {run_dir}", run_dir=run_dir)
    raise errors.LaunchError(
        f"The run ended in state {o.state} without a result (the agent process stopped "
        f"unexpectedly).\nAgent output:\n{_indent(o.agent_log_tail)}\nRun directory: {run_dir}",
        run_dir=run_dir)


def _raise_peer_failure(o: RunOutcome) -> None:
    """Another node of a ``gpulaunch run --nnodes`` job failed first; this node's ranks were
    stopped (or failed only as a consequence). Its exit code is the failed rank's."""
    p = o.peer_failure
    ours = "; ".join(f.summary() for f in o.failures)
    also = f"\nHere, as a consequence: {ours}" if ours else ""
    raise errors.WorkerCrashError(
        f"Node {p.node_rank} of the job failed: {p.summary} (host {p.host or '?'}). Every rank "
        f"of this node was stopped.{also}\nThat rank's logs are on node {p.node_rank}: "
        f"{p.run_dir or '(unknown run directory)'}\nRun directory here: {o.run_dir}",
        rank=p.rank if p.rank >= 0 else None, host=p.host or None, exit_code=p.exit_code,
        run_dir=o.run_dir)


def _raise_rank_failure(o: RunOutcome) -> None:
    root = root_cause(o.failures)
    others = [f.summary() for f in o.failures if f is not root]
    also = ("\nAlso failed (after the root cause): " + "; ".join(others)) if others else ""
    also += _earlier(o)
    log_tail = root.log_tail or "(it printed nothing)"
    where = ("the ray_launch driver" if o.entry_kind == "ray_program"
             else f"rank {root.rank} (host {root.host}, attempt {o.attempt})")
    err, run_dir = root.error, o.run_dir
    is_exit = err is not None and err.type.endswith("SystemExit")
    if err is not None and err.exception is not None and not is_exit:
        try:
            exc = pickle.loads(err.exception)
        except Exception:  # noqa: BLE001 - the class is not importable here: RemoteError below
            exc = None
        if isinstance(exc, BaseException):
            exc.__cause__ = errors.RemoteTraceback(
                f"\n\nTraceback from {where}:\n{err.traceback.rstrip()}{also}")
            for attr, value in (("rank", root.rank), ("host", root.host), ("run_dir", run_dir),
                                ("remote_traceback", err.traceback)):
                try:
                    setattr(exc, attr, value)
                except Exception:  # noqa: BLE001
                    pass
            raise exc
    if is_exit:
        code = err.exit_code if err.exit_code is not None else root.exit_code
        raise errors.WorkerCrashError(
            f"Rank {root.rank} (host {root.host}) called sys.exit({code}).{also}\n"
            f"{err.traceback.rstrip()}\nRun directory: {run_dir}",
            rank=root.rank, host=root.host, exit_code=code, log_tail=log_tail, run_dir=run_dir)
    if err is not None:
        raise errors.RemoteError(
            f"Rank {root.rank} (host {root.host}) raised {err.type}: {err.message}\n"
            f"(the exception object could not be rebuilt here){also}\n{err.traceback}",
            remote_type=err.type, remote_traceback=err.traceback, rank=root.rank,
            host=root.host, exit_code=root.exit_code, log_tail=log_tail, run_dir=run_dir)
    code = root.exit_code
    if code is not None and code < 0:
        hint = signal_hint(code, o.oom_confirmed)
        what = f"was killed by {describe_exit(code).split('by ')[-1]}"
    else:
        hint = ("It ended without raising a Python exception: os._exit(), or a native library "
                "that called exit().") if o.entry_kind == "function" else ""
        what = describe_exit(code)
    raise errors.WorkerCrashError(
        f"Rank {root.rank} (host {root.host}) {what}. {hint}{also}\n"
        f"Last lines of rank {root.rank}:\n{_indent(log_tail)}\nRun directory: {run_dir}",
        rank=root.rank, host=root.host, exit_code=code, log_tail=log_tail, run_dir=run_dir)
