"""A warm rank pool (``keep_alive=``): the ranks of a finished call stay up, with their process
group, CUDA context and NCCL communicators, and the next call with the same settings runs on
them. One more implementation of the ``Run`` protocol (``backends.base``).

    call 1   PoolRun.start -> POOLS.acquire: no pool -> RankPool.start (world_size processes
             of ``rank.pool_worker``, torch imported once) -> request -> ranks run the call
    call 2   POOLS.acquire: same PoolKey, pool idle -> request: only the payload travels
             (no process, no import torch, no CUDA/NCCL start-up; ``rt.state`` still there)

Every call gets its own run directory with the cold layout (launch.json, payload.pkl,
status.json written by us in the agent's stead, attempt0/rank<r>.log / .info.json /
.result.pkl / .error.pkl / .stacks, hang.json), so ``caller.collect`` + ``outcome.settle``
give the same results and errors as a cold call and the log streamer the same prefixes.

What keeps the pool and what ends it:
* every rank came back ("done"), results or Python exceptions alike: the pool stays;
* a rank ended (crash, signal, ``os._exit``), a hang (``hang_timeout``), ``timeout=``,
  ``cancel()`` / Ctrl-C, or one rank raised while its peers did not come back within
  ``POOL_PEER_GRACE_S`` (they wait in a collective it will never join): the pool is torn down,
  and the next call starts cold with one line saying why;
* different settings (``PoolKey``: world size, GPU type, env, start-up variables, cwd, the
  installed distributions and the user's imported modules): the old pool is closed first,
  saying so; an idle pool closes itself after ``keep_alive`` seconds;
* ``gpulaunch.shutdown()``, ``gpulaunch pool close``, the caller's exit (atexit) or death
  (the ranks see their stdin pipe close, or their parent change) release everything.

One pool per caller process, one call at a time on it. ``max_restarts`` restarts a failed call on
new ranks (the failure policy of ``caller.failure_policy``, as a cold call and Ray do): the pool
restarts cold, which drops ``rt.state``; the caller is told in one line, and the new ranks know
the keys that went (``StateDroppedError`` names the call to re-run). The same holds for any
call after a pool that ended.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time

from ...caller import collect
from ...caller.controller import RunController
from ...caller.failure_policy import Decision, FailurePolicy
from ...caller.logstream import LogStreamer
from ...caller.outcome import root_cause
from ...common import preemption, private, procutil
from ...common.records import (
    LaunchRecord,
    NodeState,
    NodeStatus,
    RankExit,
    StopReason,
)
from ...common.rundir import RunDir
from ...rank.pool_worker import IDENTITY as IDENTITY_ENV
from . import hang
from .node_hooks import NodeHooks
from .pool_ranks import RankPool, pool_rank_env
from .pool_registry import POOLS, dropped_note
from .run import child_env, describe_local

POOL_PEER_GRACE_S = 3.0   # after one rank raised, how long its peers may take to come back


class PoolRun(RunController):
    """One call on the warm pool (its lifecycle: ``RunController``)."""

    poll_interval = 0.05   # pause() wakes at once when a rank answers

    def __init__(self, record: LaunchRecord, run: RunDir, *, keep_alive: float,
                 callbacks=None, stream: bool = True, write=None):
        super().__init__(record, run, callbacks=callbacks)
        self.keep_alive = float(keep_alive)
        self.pool: RankPool | None = None
        self.warm = False
        self.attempt = 0
        self.policy = FailurePolicy(record.spec.max_restarts,    # restart or give up
                                    preemption.max_preemptions(dict(record.spec.env)))
        self._env: dict[str, str] = {}
        self._call_env: dict[str, str] = {}
        self.hooks: NodeHooks | None = None
        self._done: set[int] = set()
        self._first_error_at: float | None = None
        self._status = NodeStatus()
        self._oom_start = collect.oom_kill_count()
        self.streamer = LogStreamer(show=self.spec.shows_rank, write=write) if stream else None

    def describe(self) -> str:
        what = describe_local(self.spec)
        if self.warm:
            return f"{what}; warm pool {self.pool.pool_id}, call {self.pool.calls}"
        return f"{what}; keep_alive: the ranks stay up for the next call"

    def _start(self) -> None:
        self.record = dataclasses.replace(self.record, started=time.time())
        self.run.write_launch(self.record)
        env = child_env()
        with self._hook_output():
            self.hooks = NodeHooks(self.record, self.run, 0)
        call_env = {k: v for k, v in pool_rank_env(env, self.spec, 0, 0, 0,
                                                   run_dir=self.run.path).items()
                    if k not in IDENTITY_ENV}
        with self._hook_output():
            call_env.update(self.hooks.env())
        call_env.update(dict(self.spec.env))
        self._env, self._call_env = env, call_env
        private.mkdir(self.run.attempt_dir(self.attempt))
        if not self._send(env, call_env):
            return
        self._update(state=NodeState.RUNNING, pids=self.pool.pids, started=time.time(),
                     warm_start=self.warm, start_method="pool",
                     start_method_reason=f"keep_alive pool {self.pool.pool_id}")
        if self.streamer:
            for r in range(self.spec.world_size):
                self.streamer.watch(r, self.run.rank_file(self.attempt, r, "log"))
        with self._hook_output():
            self.hooks.on_ranks_started()

    def _send(self, env: dict[str, str], call_env: dict[str, str]) -> bool:
        """Hand the call to the pool's ranks. A warm pool whose ranks died since the last look
        (between ``acquire``'s check and the write) is torn down and the call goes to a cold
        one, once; a cold pool that cannot take it fails the call."""
        while True:
            self.pool, self.warm = POOLS.acquire(self.spec, env)
            self.pool.busy = True
            self.pool.calls += 1
            request = {"run_dir": str(self.run.path), "seq": self.pool.calls,
                       "attempt": self.attempt, "env": call_env, "cwd": self.pool.key.cwd}
            if not self.warm and getattr(self.pool, "dropped", None):
                request["dropped"] = self.pool.dropped
            try:
                self.pool.send(request)
                return True
            except OSError as e:
                why = f"a rank's request pipe closed ({e})"
                if not self.warm:
                    self._end(NodeState.FAILED, {}, teardown=why)
                    return False
                POOLS.teardown(self.pool, f"{why} while it was idle")

    @contextlib.contextmanager
    def _hook_output(self):
        """Node hooks' warnings go to the run's agent.log, where a cold run's agent puts them,
        not into the notebook on every call."""
        with private.open_file(self.run.agent_log, "a") as f, contextlib.redirect_stderr(f):
            yield

    def _update(self, **kw) -> None:
        self._status = dataclasses.replace(self._status, **kw)
        self.run.write_status(self._status)

    # ------------------------------------------------------------------ following
    def _poll(self) -> None:
        if self.streamer:
            self.streamer.pump()
        self._done |= self.pool.replies()
        n = self.spec.world_size
        exited = {r: c for r, c in self.pool.exited().items() if r not in self._done}
        errors = {r for r in self._done
                  if self.run.rank_file(self.attempt, r, "error.pkl").exists()}
        if exited:
            why = "; ".join(f"rank {r} {procutil.describe_exit(c)}"
                            for r, c in sorted(exited.items()))
            self._attempt_failed(self._exits(errors, exited), teardown=why)
        elif len(self._done) >= n:
            if errors:
                self._attempt_failed(self._exits(errors))
            else:
                self._end(NodeState.SUCCEEDED, {})
        elif errors:
            now = time.monotonic()
            self._first_error_at = self._first_error_at or now
            if now - self._first_error_at > POOL_PEER_GRACE_S:
                self._attempt_failed(self._exits(errors), teardown=(
                    f"rank {min(errors)} raised while its peers did not return (waiting in "
                    "a collective it never joined)"))
        elif self.spec.hang_timeout:
            self._check_hang()

    def pause(self, seconds: float) -> None:
        if not self.finished and self.pool is not None and self.pool.closed is None:
            self.pool.replies_wait(seconds)
        else:
            time.sleep(min(seconds, 0.01))

    def _exits(self, errors, exited=None) -> dict[int, RankExit]:
        pids = self.pool.pids
        out = {r: RankExit(rank=r, exitcode=1, local_rank=r, pid=pids[r]) for r in errors}
        out.update({r: RankExit(rank=r, exitcode=c, local_rank=r, pid=pids[r],
                                timestamp=time.time()) for r, c in (exited or {}).items()})
        return out

    def _check_hang(self) -> bool:
        """A rank's watchdog reported itself stuck: every rank's stack, then teardown (what the
        node agent does for a cold run)."""
        report = hang.stuck_report(self.run, self.attempt)
        if report is None:
            return False
        hang.record_hang(self.run, self.attempt, report, list(self.pool.pids.values()),
                         device=self.spec.device)
        self._update(hang=True)
        self._attempt_failed({}, teardown=f"a hang (rank {report.rank}, hang_timeout)")
        return True

    def _attempt_failed(self, exits: dict, *, teardown: str | None = None) -> None:
        """This attempt failed: restart the call on a cold pool while the failure policy says
        so (a restart drops rt.state; the caller is told in one line), else end the call."""
        saved = preemption.read_saved(self.run.path, self.attempt)
        if saved is not None and not saved["notice"].get("restart"):
            self._end(NodeState.FAILED, exits, teardown=teardown)   # the caller is going away
            return
        if self.policy.decide(self.attempt, stopping=self.reason is not None,
                              preempted=saved is not None) is Decision.GIVE_UP:
            self._end(NodeState.FAILED, exits, teardown=teardown)
            return
        failed = self.attempt
        cause = (f"preempted: checkpoint of step {saved['step']} saved in {saved['checkpoint']}"
                 if saved else self._cause(exits, teardown))
        POOLS.teardown(self.pool, teardown or f"attempt {failed} failed ({cause})")
        self.policy.record(failed, cause, exits, preempted=saved is not None)
        if saved is not None:
            preemption.archive_notice(self.run.path, failed)
        if self.run.hang_json.exists():      # the next attempt's hang, if any, is its own
            self.run.hang_json.replace(self.run.attempt_dir(failed) / "hang.json")
        self._update(state=NodeState.RESTARTING, hang=False, history=list(self.policy.history))
        line = (f"gpulaunch: pool: attempt {failed} failed ({cause}); restarting the call on "
                f"new ranks (attempt {failed + 1}"
                f"{'; a preemption, max_restarts not spent' if saved else ''}"
                f"{'' if saved else f' of {self.spec.max_restarts}'}): the pool "
                f"restarted cold{dropped_note(POOLS.dropped) or ', rt.state starts empty'}\n")
        if self.streamer:
            self.streamer.pump(final=True)
            self.streamer.write(line)
        else:
            sys.stdout.write(line)
        self.attempt, self._first_error_at = failed + 1, None
        self._done.clear()
        self._call_env["TORCHELASTIC_RESTART_COUNT"] = str(self.attempt)
        private.mkdir(self.run.attempt_dir(self.attempt))
        if not self._send(self._env, self._call_env):
            return
        self._update(state=NodeState.RUNNING, attempt=self.attempt, pids=self.pool.pids)
        if self.streamer:
            for r in range(self.spec.world_size):
                self.streamer.watch(r, self.run.rank_file(self.attempt, r, "log"))

    def _cause(self, exits: dict, why: str | None) -> str:
        """The failed attempt's root cause in one line."""
        hang = collect.hang_report(self.run, self.attempt, self.spec.world_size)
        if hang is not None:
            return f"hang: rank {hang.detected_by} made no progress for {hang.stuck_for:g} s"
        failures = collect.rank_failures(self.run, self.attempt, exits)
        if failures:
            return root_cause(failures).summary()
        return why or "a rank failed"

    def _stop(self, reason: StopReason) -> None:
        why = ("the call ran past timeout=" if reason is StopReason.TIMEOUT
               else "the call was cancelled")
        self._end(NodeState.STOPPED, {}, teardown=why, grace=self.spec.shutdown_grace)

    def _end(self, state: NodeState, exits: dict, *, teardown: str | None = None,
             grace: float = 0.0) -> None:
        if teardown is not None:
            POOLS.teardown(self.pool, teardown, grace)
        self._update(state=state, failures=exits, ended=time.time())
        if self.streamer:
            self.streamer.pump(final=True)
        if self.hooks is not None:
            with self._hook_output():
                self.hooks.stop()
        if teardown is None:
            POOLS.release(self.pool, self.keep_alive)
        self.ended()

    def rank_pids(self) -> list[int]:
        return sorted(self.pool.pids.values()) if self.pool else []

    # ------------------------------------------------------------------ results
    def _final_state(self) -> NodeState:
        return self._status.state

    def outcome(self):
        return collect.collect(
            self.run, state=self._status.state, world_size=self.spec.world_size, attempt=self.attempt,
            exits=self._status.failures, reason=self.reason, timeout=self.spec.timeout,
            oom_kills_at_start=self._oom_start, history=self.policy.history)
