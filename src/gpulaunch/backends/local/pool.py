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

One pool per caller process, one call at a time on it. ``max_restarts`` does not combine with a
pool (a restart would drop ``rt.state``): refused with a clear error.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time

from ...caller import collect
from ...caller.logstream import LogStreamer
from ...caller.registry import ACTIVE
from ...common import constants, private, procutil
from ...common.records import (
    HangRecord,
    LaunchRecord,
    NodeStatus,
    RankExit,
    RunState,
    StopReason,
    StuckReport,
)
from ...common.rundir import RunDir, read_json, write_json_atomic
from ...errors import ConfigurationError
from ...rank.pool_worker import IDENTITY as IDENTITY_ENV
from .node_hooks import NodeHooks
from .pool_ranks import PoolKey, RankPool, changed_file, rank_env
from .run import child_env, describe_local
from .standby import STANDBY

POOL_PEER_GRACE_S = 3.0   # after one rank raised, how long its peers may take to come back


def _say(line: str) -> None:
    if not os.environ.get("GPULAUNCH_QUIET"):
        sys.stdout.write(f"gpulaunch: pool: {line}\n")
        sys.stdout.flush()


class PoolRegistry:
    """This caller's pool (at most one), handed to one call at a time."""

    def __init__(self):
        self._lock = threading.Lock()
        self.pool: RankPool | None = None
        self.last_end: str | None = None
        self._timer: threading.Timer | None = None

    def acquire(self, spec, env: dict[str, str]) -> tuple[RankPool, bool]:
        """The pool for this call and whether it is warm; a new one when needed (saying why)."""
        key = PoolKey.of(spec, env)
        with self._lock:
            self._cancel_timer()
            pool, self.pool = self.pool, None
            if pool is not None and getattr(pool, "busy", False):
                self.pool = pool
                raise ConfigurationError(
                    "the warm pool (keep_alive=) is running another call of this process; wait "
                    "for it (handle.result()) or launch this one with keep_alive=False.")
            if pool is not None:
                exited = pool.exited()
                if pool.closed is not None:
                    self.last_end = pool.closed
                elif pool.record_removed():
                    pool.close("closed by `gpulaunch pool close`")
                    self.last_end = "it was closed by `gpulaunch pool close`"
                elif exited:
                    why = "; ".join(f"rank {r} {procutil.describe_exit(c)}"
                                    for r, c in sorted(exited.items()))
                    pool.close(why)
                    self.last_end = f"{why} while it was idle"
                elif changed_file(pool.user_files):
                    why = f"{changed_file(pool.user_files)} changed since the pool started"
                    pool.close(why)
                    self.last_end = why
                elif not key.differs(pool.key):
                    self.pool = pool
                    return pool, True
                else:
                    _say(f"the settings changed ({key.differs(pool.key)}): closing warm pool "
                         f"{pool.pool_id} and starting a new one (cold)")
                    pool.close("settings changed")
                    self.last_end = None
            if self.last_end:
                _say(f"starting a new pool (cold): the previous one ended: {self.last_end}")
                self.last_end = None
            pool = RankPool(key, spec, env).start()
            self.pool = pool
            return pool, False

    def teardown(self, pool: RankPool, why: str, grace: float = 0.0) -> None:
        pool.close(why, grace)
        with self._lock:
            if self.pool is pool:
                self.pool = None
                self.last_end = why

    def release(self, pool: RankPool, idle_s: float) -> None:
        """The call is over and the pool usable: wait for the next call, at most ``idle_s``."""
        with self._lock:
            pool.busy = False
            pool.last_used = time.time()
            pool.write_record()
            self._cancel_timer()
            self._timer = threading.Timer(idle_s, self._expire, args=(pool, idle_s))
            self._timer.daemon = True
            self._timer.start()

    def _expire(self, pool: RankPool, idle_s: float) -> None:
        with self._lock:
            if self.pool is not pool or getattr(pool, "busy", False):
                return
            self.pool = None
            self.last_end = f"it was idle for {idle_s:g} s (keep_alive)"
        pool.close(self.last_end)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def close(self, why: str = "closed") -> RankPool | None:
        """Close this caller's pool now (between calls or during one: its ranks end)."""
        with self._lock:
            self._cancel_timer()
            pool, self.pool = self.pool, None
        if pool is not None:
            pool.close(why)
        return pool


POOLS = PoolRegistry()
atexit.register(POOLS.close, "the caller exited")


def shutdown() -> None:
    """Release everything this process keeps between calls: the warm pool's ranks (and the
    GPUs they hold) and the standby agent."""
    POOLS.close("gpulaunch.shutdown()")
    STANDBY.close()


class PoolRun:
    """One call on the warm pool (``Run`` protocol)."""

    poll_interval = 0.05   # pause() wakes at once when a rank answers

    def __init__(self, record: LaunchRecord, run: RunDir, *, keep_alive: float,
                 callbacks=None, stream: bool = True, write=None):
        self.record, self.spec, self.run, self.label = record, record.spec, run, record.label
        self.keep_alive = float(keep_alive)
        self.callbacks = callbacks
        self.reason: StopReason | None = None
        self.finished = False
        self.pool: RankPool | None = None
        self.warm = False
        self.hooks: NodeHooks | None = None
        self._lock = threading.RLock()
        self._done: set[int] = set()
        self._first_error_at: float | None = None
        self._deadline: float | None = None
        self._status = NodeStatus()
        self._oom_start = collect.oom_kill_count()
        self.streamer = LogStreamer(show=self.spec.shows_rank, write=write) if stream else None

    def describe(self) -> str:
        what = describe_local(self.spec)
        if self.warm:
            return f"{what}; warm pool {self.pool.pool_id}, call {self.pool.calls}"
        return f"{what}; keep_alive: the ranks stay up for the next call"

    def start(self) -> "PoolRun":
        if self.spec.max_restarts:     # here, not earlier: start() failing ends the callbacks
            raise ConfigurationError(
                f"keep_alive= and max_restarts={self.spec.max_restarts} do not combine: a "
                "restart would drop rt.state. Use one or the other.")
        self.record = dataclasses.replace(self.record, started=time.time())
        self.run.write_launch(self.record)
        env = child_env()
        with self._hook_output():
            self.hooks = NodeHooks(self.record, self.run, 0)
        call_env = {k: v for k, v in rank_env(env, self.spec, 0, 0, 0).items()
                    if k not in IDENTITY_ENV}
        call_env.pop("GPULAUNCH_HANG_TIMEOUT", None)     # a setting of one launch (spec.env)
        with self._hook_output():
            call_env.update(self.hooks.env())
        call_env.update(dict(self.spec.env))
        call_env["GPULAUNCH_RUN_DIR"] = str(self.run.path)
        private.mkdir(self.run.attempt_dir(0))
        if not self._send(env, call_env):
            return self
        self._update(state=RunState.RUNNING, pids=self.pool.pids, started=time.time(),
                     warm_start=self.warm, start_method="pool",
                     start_method_reason=f"keep_alive pool {self.pool.pool_id}")
        if self.streamer:
            for r in range(self.spec.world_size):
                self.streamer.watch(r, self.run.rank_file(0, r, "log"))
        with self._hook_output():
            self.hooks.on_ranks_started()
        if self.spec.timeout is not None:
            self._deadline = time.monotonic() + self.spec.timeout
        return self

    def _send(self, env: dict[str, str], call_env: dict[str, str]) -> bool:
        """Hand the call to the pool's ranks. A warm pool whose ranks died since the last look
        (between ``acquire``'s check and the write) is torn down and the call goes to a cold
        one, once; a cold pool that cannot take it fails the call."""
        while True:
            self.pool, self.warm = POOLS.acquire(self.spec, env)
            self.pool.busy = True
            self.pool.calls += 1
            try:
                self.pool.send({"run_dir": str(self.run.path), "seq": self.pool.calls,
                                "env": call_env, "cwd": self.pool.key.cwd})
                return True
            except OSError as e:
                why = f"a rank's request pipe closed ({e})"
                if not self.warm:
                    self._end(RunState.FAILED, {}, teardown=why)
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
    def poll(self) -> bool:
        with self._lock:
            if self.finished:
                return True
            if self.streamer:
                self.streamer.pump()
            self._done |= self.pool.replies()
            n = self.spec.world_size
            exited = {r: c for r, c in self.pool.exited().items() if r not in self._done}
            errors = {r for r in self._done if self.run.rank_file(0, r, "error.pkl").exists()}
            if exited:
                why = "; ".join(f"rank {r} {procutil.describe_exit(c)}"
                                for r, c in sorted(exited.items()))
                self._end(RunState.FAILED, self._exits(errors, exited), teardown=why)
            elif len(self._done) >= n:
                self._end(RunState.FAILED if errors else RunState.SUCCEEDED, self._exits(errors))
            elif errors:
                now = time.monotonic()
                self._first_error_at = self._first_error_at or now
                if now - self._first_error_at > POOL_PEER_GRACE_S:
                    self._end(RunState.FAILED, self._exits(errors), teardown=(
                        f"rank {min(errors)} raised while its peers did not return (waiting in "
                        "a collective it never joined)"))
            elif self.spec.hang_timeout and self._check_hang():
                pass
            elif self._deadline is not None and time.monotonic() > self._deadline:
                self.stop(StopReason.TIMEOUT)
            return self.finished

    step = poll

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
        adir = self.run.attempt_dir(0)
        stuck = sorted(adir.glob("rank*.stuck"))
        if not stuck:
            return False
        report = StuckReport.from_data(read_json(stuck[0], {}) or {
            "rank": -1, "stuck_for": 0, "since_unix": 0, "where": ""})
        pids = list(self.pool.pids.values())
        if self.spec.device == "cuda":
            (adir / "dump_request").touch()
        procutil.kill_pids(pids, signal.SIGUSR1)
        time.sleep(constants.STACK_DUMP_WAIT_S)
        write_json_atomic(self.run.hang_json, HangRecord(
            detected_by=report.rank, attempt=0, stuck_for=report.stuck_for, where=report.where,
            time=time.time(), node_rank=0).to_data())
        self._update(hang=True)
        self._end(RunState.FAILED, {}, teardown=f"a hang (rank {report.rank}, hang_timeout)")
        return True

    def stop(self, reason: StopReason) -> None:
        with self._lock:
            if self.finished:
                return
            self.reason = self.reason or StopReason(reason)
            why = ("the call ran past timeout=" if self.reason is StopReason.TIMEOUT
                   else "the call was cancelled")
            self._end(RunState.STOPPED, {}, teardown=why, grace=self.spec.shutdown_grace)

    def _end(self, state: RunState, exits: dict, *, teardown: str | None = None,
             grace: float = 0.0) -> None:
        if teardown is not None:
            POOLS.teardown(self.pool, teardown, grace)
        self._update(state=state, failures=exits, ended=time.time())
        self.finished = True
        ACTIVE.discard(self)
        if self.streamer:
            self.streamer.pump(final=True)
        if self.hooks is not None:
            with self._hook_output():
                self.hooks.stop()
        if teardown is None:
            POOLS.release(self.pool, self.keep_alive)
        if self.callbacks is not None:
            self.callbacks.on_end(self, self.state)

    def rank_pids(self) -> list[int]:
        return sorted(self.pool.pids.values()) if self.pool else []

    # ------------------------------------------------------------------ results
    @property
    def state(self) -> RunState:
        if not self.finished:
            return RunState.RUNNING if self.pool is not None else RunState.PENDING
        if self.reason is StopReason.TIMEOUT:
            return RunState.TIMED_OUT
        if self.reason is StopReason.CANCELLED:
            return RunState.CANCELLED
        return RunState.SUCCEEDED if self._status.state is RunState.SUCCEEDED \
            else RunState.FAILED

    def outcome(self):
        return collect.collect(
            self.run, state=self._status.state, world_size=self.spec.world_size, attempt=0,
            exits=self._status.failures, reason=self.reason, timeout=self.spec.timeout,
            oom_kills_at_start=self._oom_start)
