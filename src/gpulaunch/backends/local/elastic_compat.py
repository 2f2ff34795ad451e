"""Every use of torch.distributed.elastic's private API, in one place.

The node agent is torchelastic's ``LocalElasticAgent`` (the machinery behind torchrun). What
gpulaunch needs beyond its public surface is done here and nowhere else, so that a torch
upgrade breaks one module, and ``missing_private_api()`` says what broke
(``tests/launch/test_elastic_compat.py`` runs it on torch 2.14 here and 2.11 on the GPU host):

* overridden protected methods: ``_start_workers`` (fork every rank behind a gate, then
  report), ``_monitor_workers`` (forked ranks succeed by exit code), ``_restart_workers``
  (record the failed attempt), ``_shutdown`` (our grace period on every torch version);
* protected state: ``_pcontext``, ``_remaining_restarts``, ``_start_method``;
* the fork context's internals: ``MultiprocessContext._pc.processes``, ``_poll``, ``_close``,
  ``error_files`` (made to behave like the spawn context: ``_like_spawned_ranks``);
* ``shutdown_timeout``, which newer torch takes and 2.11 hard-codes to 30 s.

The agent (``agent.py``) talks to ``ElasticAgent`` through three plain hooks instead.
"""

from __future__ import annotations

import inspect
import os
import signal
import time
from typing import Callable

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from ...common import constants, procutil
from ...common.records import RankExit

FORK_GATE_ENV = constants.FORK_GATE_ENV
JOIN_SIGKILL_AFTER_S = 29.0   # torch.multiprocessing ProcessContext.join: SIGTERM, 30 s, SIGKILL


def missing_private_api() -> list[str]:
    """The private names this module relies on that the installed torch lacks."""
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext
    missing = []
    for name in ("_start_workers", "_monitor_workers", "_restart_workers", "_shutdown"):
        if not callable(getattr(LocalElasticAgent, name, None)):
            missing.append(f"LocalElasticAgent.{name}")
    for name in ("_poll", "_close"):
        if not callable(getattr(MultiprocessContext, name, None)):
            missing.append(f"MultiprocessContext.{name}")
    params = inspect.signature(LocalElasticAgent.__init__).parameters
    for name in ("spec", "logs_specs", "start_method"):
        if name not in params:
            missing.append(f"LocalElasticAgent.__init__({name}=)")
    return missing


def exits_from(failures: dict) -> dict[int, RankExit]:
    """torchelastic's {global rank: ProcessFailure} as records."""
    return {int(rank): RankExit(rank=int(rank), exitcode=f.exitcode, local_rank=f.local_rank,
                                pid=f.pid, timestamp=float(f.timestamp or 0.0),
                                message=str(f.message or ""))
            for rank, f in failures.items()}


class ElasticAgent(LocalElasticAgent):
    """LocalElasticAgent with a fork gate, forked-rank success, our grace period and hooks:

    before_start(worker_group)              rendezvous ordering (multi-node), before forks
    on_started(pids, attempt, forked_at)    {global rank: pid} once every rank is running
    on_restart(attempt, exits)              an attempt failed and the next one starts
    preempted(attempt)                      a failed attempt was preempted: "restart" (without
                                            spending max_restarts), "stop", or None (a failure)
    """

    def __init__(self, spec, *, logs_specs, start_method: str, shutdown_grace: float,
                 before_start: Callable | None = None, on_started: Callable | None = None,
                 on_restart: Callable | None = None, first_attempt: int = 0,
                 preempted: Callable | None = None, free_membership_restarts: bool = False):
        kw = {}
        if "shutdown_timeout" in inspect.signature(LocalElasticAgent.__init__).parameters:
            kw["shutdown_timeout"] = max(1, int(round(shutdown_grace)))
        super().__init__(spec, logs_specs=logs_specs, start_method=start_method, **kw)
        self.shutdown_grace = shutdown_grace
        self.before_start = before_start
        self.on_started = on_started
        self.on_restart = on_restart
        self.preempted = preempted
        self.free_membership_restarts = free_membership_restarts   # --nnodes MIN:MAX
        self._last_result = None
        self._attempt = first_attempt
        if first_attempt:
            # Attempt k of a job that its caller restarts (Ray): torchelastic numbers attempts
            # max_restarts - remaining (TORCHELASTIC_RESTART_COUNT, attempt<k>/), so the ranks
            # see k, and this agent, with spec.max_restarts == k, has no restart of its own.
            self._remaining_restarts = max(0, spec.max_restarts - first_attempt)

    @property
    def attempt(self) -> int:
        return self._attempt

    def _shutdown(self, death_sig=signal.SIGTERM, *args, **kwargs):
        # Stop the ranks with our grace period (SIGTERM, then SIGKILL) whatever the torch
        # version; torchelastic's own shutdown then finds them gone.
        if self._pcontext is not None:
            self._pcontext.close(death_sig, timeout=max(1, int(round(self.shutdown_grace))))
        return super()._shutdown(death_sig, *args, **kwargs)

    def _start_workers(self, worker_group):
        if self.before_start is not None:
            self.before_start(worker_group)
        forked_at = None
        if self._start_method != "fork":
            pids = super()._start_workers(worker_group)
        else:
            pids = self._fork_workers_behind_a_gate(worker_group)
            forked_at = time.time()
            _like_spawned_ranks(self._pcontext)
        self._attempt = worker_group.spec.max_restarts - self._remaining_restarts
        ranks = {w.local_rank: w.global_rank for w in worker_group.workers}
        if self.on_started is not None:
            self.on_started({ranks[lr]: pid for lr, pid in pids.items()}, self._attempt,
                            forked_at)
        return pids

    def _fork_workers_behind_a_gate(self, worker_group):
        """Fork every rank, and only then let them run.

        A forked child inherits every lock of the agent in the state it had at the fork, and
        only the forking thread survives to release them. Threads of the agent do network work
        while ranks are forked one by one: the rendezvous stores' server threads accept the
        first ranks' connections and, for each, resolve the peer's address (``getnameinfo``),
        which holds glibc's resolver lock. A rank forked at that moment inherits that lock held
        and hangs forever in its own first ``getnameinfo`` (inside ``init_process_group``):
        measured here, 1 launch in 18 to 1 in 60 of 4 ranks on 2 cores. So each rank waits on a
        pipe before doing anything, the agent closes it once the last fork is done, and the
        agent's own helper threads make no network call while it forks
        (``procutil.FORK_QUIET``, bounded: a hung tracking server must not hold a restart)."""
        read_end, write_end = os.pipe()
        os.environ[FORK_GATE_ENV] = f"{read_end},{write_end}"
        quiet = procutil.FORK_QUIET.acquire(timeout=constants.FORK_QUIET_WAIT_S)
        try:
            return super()._start_workers(worker_group)
        finally:
            if quiet:
                procutil.FORK_QUIET.release()
            os.environ.pop(FORK_GATE_ENV, None)
            os.close(write_end)            # EOF on the ranks' read ends: go
            os.close(read_end)

    def _monitor_workers(self, worker_group):
        result = super()._monitor_workers(worker_group)
        if self._start_method == "fork" and result.state == WorkerState.HEALTHY:
            result = self._forked_success(worker_group) or result
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) \
                and self.preempted is not None:
            self._count_preemption(worker_group, self.preempted(self._attempt))
        self._last_result = result
        return result

    def _count_preemption(self, worker_group, verdict: str | None) -> None:
        """A preempted attempt is restarted outside torchelastic's restart budget: one more
        restart in the spec and in the remaining count, so that its decrement spends the
        preemption's and the attempt numbers (TORCHELASTIC_RESTART_COUNT, attempt<k>/) go on;
        a preemption that must not restart here stops the loop whatever the budget."""
        if verdict == "restart":
            worker_group.spec.max_restarts += 1
            self._remaining_restarts += 1
        elif verdict == "stop":
            self._remaining_restarts = 0

    def _forked_success(self, worker_group):
        """Forked ranks end with ``os._exit(0)`` (so a stray thread can never hang their exit)
        instead of handing a return value to torchelastic's queue, on which its
        MultiprocessContext would wait forever. All ranks exited 0 = the group succeeded."""
        procs = getattr(getattr(self._pcontext, "_pc", None), "processes", None)
        if not procs or any(p.exitcode != 0 for p in procs):
            return None
        self._pcontext.close()
        return RunResult(state=WorkerState.SUCCEEDED,
                         return_values={w.global_rank: None for w in worker_group.workers})

    def _restart_workers(self, worker_group):
        failed = self._last_result is not None and self._last_result.failures
        if failed and self.on_restart is not None:
            self.on_restart(self._attempt, exits_from(self._last_result.failures))
        if not failed and self.free_membership_restarts:
            # An elastic job's node waits to join: as in torchrun, a membership change spends
            # no restart; one more in the spec keeps the attempt numbers going
            # (TORCHELASTIC_RESTART_COUNT, attempt<k>/) while the budget left stays the same.
            worker_group.spec.max_restarts += 1
            if self.on_restart is not None:
                self.on_restart(self._attempt, {})
        elif not failed and self._remaining_restarts > 0:
            # A healthy group restarted because another node restarts (``num_nodes_waiting``):
            # torchelastic does not count that as a restart, but the job's attempt is the same
            # on every node (TORCHELASTIC_RESTART_COUNT, attempt<k>/ folders), so count it.
            self._remaining_restarts -= 1
            if self.on_restart is not None:
                self.on_restart(self._attempt, {})
        super()._restart_workers(worker_group)

    def current_pids(self) -> list[int]:
        pc = self._pcontext
        return list(pc.pids().values()) if pc is not None else []


def _like_spawned_ranks(pcontext) -> None:
    """Make torchelastic's MultiprocessContext (fork) behave as its SubprocessContext (spawn)
    does in the two ways the run's reports and cleanup rely on:

    * it reports only the FIRST failed rank it notices; SubprocessContext reports every rank
      that had failed by that poll. Several ranks failing within one poll is common (the
      culprit, then its peers' "connection closed"), and the root cause needs them all;
    * it stops a rank by signalling its pid; SubprocessContext signals the rank's process
      group (each rank has its own session), which also reaches the rank's children.
    """
    poll, close = pcontext._poll, pcontext._close

    def poll_all():
        procs = getattr(getattr(pcontext, "_pc", None), "processes", None) or []
        # Exit codes before torchelastic's poll, and after it: on a failure that poll SIGTERMs
        # (later SIGKILLs) the survivors, so afterwards a death by those signals is ours, not
        # theirs; any other exit code is a rank that failed by itself in the same instant.
        exited = {lr: (p.pid, p.exitcode) for lr, p in enumerate(procs)
                  if p.exitcode not in (None, 0)}
        began = time.monotonic()
        result = poll()
        if result is not None and result.is_failed():
            # That poll SIGKILLs a survivor only once it ignored the SIGTERM for 30 s
            # (ProcessContext.join). A SIGKILL seen sooner is the rank's own (kill -9, the OOM
            # killer), often in the same instant as its peers' "connection closed": a cause.
            ours = (None, 0, -signal.SIGTERM) + (
                (-signal.SIGKILL,) if time.monotonic() - began >= JOIN_SIGKILL_AFTER_S else ())
            exited.update({lr: (p.pid, p.exitcode) for lr, p in enumerate(procs)
                           if lr not in exited and p.exitcode not in ours})
            for lr, (pid, code) in exited.items():
                if lr not in result.failures:
                    result.failures[lr] = ProcessFailure(local_rank=lr, pid=pid, exitcode=code,
                                                         error_file=pcontext.error_files[lr])
        return result

    def close_groups(death_sig, timeout=30):
        pc = getattr(pcontext, "_pc", None)
        pids = [p.pid for p in pc.processes] if pc is not None else []
        procutil.kill_process_groups([p.pid for p in pc.processes if p.is_alive()] if pc else [],
                                     death_sig)
        close(death_sig=death_sig, timeout=timeout)   # waits, then SIGKILLs the ranks
        for pid in pids:                              # and what is left of their groups
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    pcontext._poll = poll_all
    pcontext._close = close_groups
