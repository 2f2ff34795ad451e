"""Caller side of a single-host run (``Run`` protocol): start the node agent, follow it, stop
it, report its outcome.

The caller never imports torch for this and never runs anything of the user's: it starts one
agent process (``agent.py``) in a new session with a pipe on its stdin, tails the ranks' log
files, enforces ``timeout=``, and on the way out makes sure no process of the run survives.
A Ray node actor uses the same class for its node's share of a job (``stream=False``, a
``NodePlacement`` in the record, no callbacks: the Ray caller has them).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ...caller import collect
from ...caller.controller import RunController
from ...caller.logstream import LogStreamer
from ...common import constants, procutil, redact
from ...common.records import LaunchRecord, NodeState, StopReason
from ...common.rundir import RunDir
from ...errors import ConfigurationError
from .standby import STANDBY

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])  # the folder holding "gpulaunch/"


def _site_dirs() -> set[str]:
    import site
    import sysconfig
    dirs = set(site.getsitepackages()) | {site.getusersitepackages()}
    dirs |= {sysconfig.get_paths().get(k) for k in ("purelib", "platlib", "stdlib")}
    return {os.path.realpath(d) for d in dirs if d}


def _installed_importable(root: str) -> bool:
    """Would a fresh interpreter import this very gpulaunch without help? Yes when it lives in a
    site directory, or a .pth file there (an editable install) names its root."""
    real = os.path.realpath(root)
    sites = _site_dirs()
    if real in sites or "site-packages" in real or "dist-packages" in real:
        return True
    for d in sites:
        try:
            names = [n for n in os.listdir(d) if n.endswith(".pth")]
        except OSError:
            continue
        for name in names:
            try:
                with open(os.path.join(d, name)) as f:
                    if any(os.path.realpath(line.strip()) == real for line in f
                           if line.strip() and not line.startswith(("#", "import"))):
                        return True
            except OSError:
                continue
    return False


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The caller's environment, PYTHONPATH unchanged. Only a source checkout that a child could
    not otherwise import gets its root (the folder holding gpulaunch/, nothing else) put first,
    so the children run this very gpulaunch. An installed gpulaunch adds nothing: its root is
    site-packages, which first on PYTHONPATH would shadow the standard library."""
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    real_paths = {os.path.realpath(p) for p in paths}
    if os.path.realpath(_PACKAGE_ROOT) not in real_paths and \
            not _installed_importable(_PACKAGE_ROOT):
        env["PYTHONPATH"] = os.pathsep.join([_PACKAGE_ROOT] + paths)
    if extra:
        env.update(extra)
    return env


def describe_local(spec) -> str:
    """The announcement of a run on this host."""
    if spec.device == "cpu":
        share = f"{spec.nproc_per_node} of the job's " if spec.nnodes > 1 else ""
        return f"{share}{spec.world_size} CPU worker processes (no GPU on this host; gloo backend)"
    what = (f"{spec.world_size} GPU rank(s) "
            f"({spec.gpu_type.name if spec.gpu_type else 'GPU'}, nccl)")
    if spec.world_size == 1:
        what += "; @distributed is meant for several GPUs, this runs one"
    return what


class LocalRun(RunController):
    """One run on this host: a node agent process (``agent.py``) that runs the ranks."""

    poll_interval = constants.POLL_LOCAL_S

    def __init__(self, record: LaunchRecord, run: RunDir, *, callbacks=None,
                 stream: bool = True, write=None, standby: bool = False):
        super().__init__(record, run, callbacks=callbacks)
        # Use (and afterwards restart) a standby agent with torch imported (standby.py): for
        # callers that launch again and again, never for a node of a multi-node job.
        self.standby = standby and record.placement.nnodes == 1
        self.proc: subprocess.Popen | None = None
        self._attempt_seen = -1
        self._world_seen = 0              # --nnodes MIN:MAX: the world size last announced
        self._oom_start = collect.oom_kill_count()
        self.streamer = LogStreamer(show=self.spec.shows_rank, write=write) if stream else None

    def describe(self) -> str:
        p = self.record.placement
        if p.elastic:         # --nnodes MIN:MAX: the world size follows the nodes present
            return describe_local(self.spec).replace(
                "of the job's ", f"of the job's {p.min_nodes * self.spec.nproc_per_node} to ", 1)
        return describe_local(self.spec)

    # ------------------------------------------------------------------ start, poll, stop
    def _start(self) -> None:
        method = os.environ.get("GPULAUNCH_START_METHOD", "").strip().lower()
        if method not in ("", "fork", "spawn"):
            raise ConfigurationError(f"GPULAUNCH_START_METHOD={method!r}: use 'fork' (the default: "
                                     "ranks forked from the agent) or 'spawn' (fresh interpreters).")
        import dataclasses
        self.record = dataclasses.replace(self.record, started=time.time())
        self.run.write_launch(self.record)           # redacted on disk; the values go:
        env = child_env(redact.secrets_env(self.record))   # in the agent's environment only
        if self.standby:
            self.proc = STANDBY.take(str(self.run.path), env, os.getcwd())
        if self.proc is None:
            with open(os.open(self.run.agent_log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
                      "wb") as agent_log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "gpulaunch.backends.local.agent", str(self.run.path),
                     "--node-rank", str(self.record.placement.node_rank), "--watch-stdin"],
                    stdin=subprocess.PIPE, stdout=agent_log, stderr=subprocess.STDOUT,
                    start_new_session=True, env=env, close_fds=True)

    def _poll(self) -> None:
        """Stream new log lines; the run is over when its agent exits."""
        self._follow_attempts()
        if self.record.placement.elastic:
            self._follow_world()
        if self.streamer:
            self.streamer.pump()
        if self.proc.poll() is not None:
            self._finalize()

    def pause(self, seconds: float) -> None:
        """Sleep between polls, but wake as soon as the agent exits (the end of every run)."""
        try:
            self.proc.wait(seconds)
        except subprocess.TimeoutExpired:
            pass

    def _stop(self, reason: StopReason) -> None:
        """Stop every process of the run: SIGTERM the agent (it stops the ranks with the
        grace period), then SIGKILL anything still there."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(self.spec.shutdown_grace + constants.AGENT_STOP_EXTRA_S)
            except subprocess.TimeoutExpired:
                procutil.kill_process_groups([self.proc.pid], signal.SIGKILL)
                self.proc.wait()
        self._finalize()

    def _finalize(self) -> None:
        """The agent ended: collect the last of its output, leave nothing behind, end."""
        if self.proc is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        self._follow_attempts()
        if self.streamer:
            self.streamer.pump(final=True)
        self.kill_leftovers()
        self.run.drop_payload()   # an agent killed before it could: nothing reads it any more
        self.ended()
        if self.standby:
            STANDBY.replenish(child_env())  # the next run's agent, importing torch meanwhile

    def kill_leftovers(self) -> list[int]:
        """Any rank (or a rank's child) still alive after its agent ended is killed now."""
        left = [p for p in self.run.rank_pids() if procutil.pid_alive(p)]
        if left:
            procutil.kill_process_groups(left, signal.SIGKILL)
        return left

    def rank_pids(self) -> list[int]:
        return self.run.rank_pids()

    def _follow_attempts(self) -> None:
        attempts = self.run.attempts()
        if not attempts or attempts[-1] == self._attempt_seen:
            return
        latest = attempts[-1]
        if self._attempt_seen >= 0 and self.streamer:
            history = self.run.status(self.record.placement.node_rank).history
            why = ""
            if history:
                why = "; ".join(f"rank {r} {procutil.describe_exit(f.exitcode)}"
                                for r, f in sorted(history[-1].failures.items()))
            if history and history[-1].membership:
                spent = sum(1 for h in history if not (h.membership or h.preempted))
                self.streamer.write(f"gpulaunch: attempt {self._attempt_seen}: a node waits to "
                                    f"join; restarting all ranks (attempt {latest}; "
                                    f"{spent} of max_restarts={self.spec.max_restarts} spent)\n")
            elif history and history[-1].preempted:
                n = sum(1 for h in history if h.preempted)
                self.streamer.write(f"gpulaunch: attempt {self._attempt_seen} {history[-1].cause}"
                                    f"; restarting all ranks from it (attempt {latest}; "
                                    f"preemption {n}, max_restarts not spent)\n")
            else:
                budget = f"attempt {latest} of {self.spec.max_restarts}"
                if self.record.placement.elastic:    # membership changes are attempts too
                    spent = sum(1 for h in history if not (h.membership or h.preempted))
                    budget = (f"attempt {latest}; {spent} of max_restarts="
                              f"{self.spec.max_restarts} spent")
                self.streamer.write(f"gpulaunch: attempt {self._attempt_seen} failed ({why}); "
                                    f"restarting all ranks ({budget})\n")
        self._attempt_seen = latest
        if self.streamer:
            for r in range(self.spec.world_size):
                self.streamer.watch(r, self.run.rank_file(latest, r, "log"))

    def _follow_world(self) -> None:
        """An elastic run: one line each time this node's ranks start in a new world size."""
        status = self.run.status(self.record.placement.node_rank)
        if not status.world_size or status.world_size == self._world_seen or \
                status.state != NodeState.RUNNING:
            return
        p = self.record.placement
        was = f"{self._world_seen} -> " if self._world_seen else ""
        self._world_seen = status.world_size
        if self.streamer:
            self.streamer.write(f"gpulaunch: world size {was}{status.world_size}: {status.nnodes}"
                                f" node(s) of {p.min_nodes}:{p.nnodes}, this one is node "
                                f"{status.group_rank} (attempt {status.attempt})\n")

    # ------------------------------------------------------------------ results
    def _final_state(self) -> NodeState:
        return self.run.status(self.record.placement.node_rank).state

    def outcome(self):
        status = self.run.status(self.record.placement.node_rank)
        attempts = self.run.attempts()
        attempt = status.attempt if status.attempt or not attempts else attempts[-1]
        return collect.collect(
            self.run, state=status.state, world_size=self.spec.world_size, attempt=attempt,
            exits=status.failures, reason=self.reason, timeout=self.spec.timeout,
            agent_error=status.error, agent_traceback=status.traceback,
            oom_kills_at_start=self._oom_start, peer_failure=status.peer_failure,
            history=status.history)
