"""Caller side of a single-host run: start the node agent, follow it, stop it, read the outcome.

The caller never imports torch for this and never runs anything of the user's: it starts one
agent process (``agent.py``) in a new session with a pipe on its stdin, tails the ranks' log
files, enforces ``timeout=``, and on the way out makes sure no process of the run survives.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ...errors import ConfigurationError
from ...launch import procutil, report
from ...launch.logstream import LogStreamer
from ...launch.rundir import RunDir, hostname, read_json, write_json_atomic
from ...launch.spec import LaunchSpec
from .standby import STANDBY

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])  # the folder holding "gpulaunch/"


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The caller's environment, plus gpulaunch importable in the children (dev checkouts)."""
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if _PACKAGE_ROOT not in paths:
        env["PYTHONPATH"] = os.pathsep.join([_PACKAGE_ROOT] + paths)
    if extra:
        env.update(extra)
    return env


def step_until_done(step, poll: float, timeout: float | None, pause=time.sleep) -> bool:
    """Call a run's ``step()`` every ``poll`` s until it reports the end (True), or until
    ``timeout`` s have passed (False; the run goes on). Local and Ray runs alike; ``pause``
    may return early when the run has news (a local agent that exited)."""
    end = None if timeout is None else time.monotonic() + timeout
    while not step():
        if end is not None and time.monotonic() > end:
            return False
        pause(poll)
    return True


@dataclasses.dataclass(frozen=True)
class NodePlacement:
    """Where this host's agent sits in the job. The default is a single host, everything on
    loopback. A multi-node backend (``backends/ray``) gives node 0 the address its rendezvous
    store binds (its own cluster IP, port 0 = chosen there) and the other nodes where to find it.
    """

    node_rank: int = 0
    nnodes: int = 1
    bind_host: str = "127.0.0.1"          # node 0: the interface the store listens on
    master_addr: str | None = None        # nodes > 0: node 0's address (None: bind_host)
    master_port: int = 0                  # nodes > 0: node 0's store port
    master_port_file: str | None = None   # nodes > 0: ...or a file where it will appear, so
    #                                       the agent starts (imports torch) while node 0 does

    def launch_fields(self) -> dict:
        return {"nnodes": self.nnodes, "node_rank": self.node_rank, "bind_host": self.bind_host,
                "master_addr": self.master_addr, "port": self.master_port,
                "port_file": self.master_port_file}


class LocalRun:
    """One run on this host. ``step()`` advances it; ``stop()`` ends it; ``outcome()`` reads it."""

    def __init__(self, spec: LaunchSpec, run: RunDir, entry: dict, *, label: str,
                 stream: bool = True, write=None, node: "NodePlacement | None" = None, tracker=None,
                 tracking_fields: dict | None = None, standby: bool = False):
        self.spec = spec
        self.node = node or NodePlacement()
        # Use (and afterwards restart) a standby agent with torch imported (standby.py): for
        # callers that launch again and again (notebooks, the Python API), never for a node of
        # a multi-node job or a one-shot CLI launch.
        self.standby = standby and node is None
        self.warm_start = False             # this run's agent was a standby
        self.run = run
        self.entry = entry
        self.label = label
        self.tracker = tracker              # gpulaunch.tracking.caller.CallTracker or None
        # A node of a multi-node run: the MLflow ids its caller's tracker already created
        # (the caller, not this node, opens and closes the run).
        self.tracking_fields = tracking_fields
        self.reason: str | None = None      # "timeout" / "cancelled" when we stopped it
        self.proc: subprocess.Popen | None = None
        self.finished = False
        self._lock = threading.RLock()
        self._attempt_seen = -1
        self._deadline: float | None = None
        self._oom_start = report.oom_kill_count()
        self.streamer = LogStreamer(show=spec.shows_rank, write=write) if stream else None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "LocalRun":
        method = os.environ.get("GPULAUNCH_START_METHOD", "").strip().lower()
        if method not in ("", "fork", "spawn"):
            raise ConfigurationError(f"GPULAUNCH_START_METHOD={method!r}: use 'fork' (the default: "
                                     "ranks forked from the agent) or 'spawn' (fresh interpreters).")
        launch = {
            "spec": dataclasses.asdict(self.spec),
            "entry": self.entry,
            "label": self.label,
            **self.node.launch_fields(),
            "caller_pid": os.getpid(),
            "host": hostname(),
            "cwd": os.getcwd(),
            "argv": sys.argv,
            "started": time.time(),
            "world_size": self.spec.world_size,
        }
        if self.tracker is not None:        # tracking hook: the agent hands MLflow ids to ranks
            launch["tracking"] = self.tracker.launch_fields()
        elif self.tracking_fields:
            launch["tracking"] = self.tracking_fields
        write_json_atomic(self.run.launch_json, launch)
        env = child_env()
        if self.standby:
            self.proc = STANDBY.take(str(self.run.path), env, os.getcwd())
            self.warm_start = self.proc is not None
        if self.proc is None:
            with open(self.run.agent_log, "wb") as agent_log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "gpulaunch.backends.local.agent", str(self.run.path),
                     "--node-rank", str(self.node.node_rank), "--watch-stdin"],
                    stdin=subprocess.PIPE, stdout=agent_log, stderr=subprocess.STDOUT,
                    start_new_session=True, env=env, close_fds=True)
        if self.spec.timeout is not None:
            self._deadline = time.monotonic() + self.spec.timeout
        _ACTIVE.add(self)
        return self

    def step(self) -> bool:
        """Stream new log lines, enforce the timeout; True once the run has ended."""
        with self._lock:
            if self.finished:
                return True
            self._follow_attempts()
            if self.streamer:
                self.streamer.pump()
            if self.proc.poll() is not None:
                self._finalize()
                return True
            if self._deadline is not None and time.monotonic() > self._deadline:
                self.stop("timeout")
                return True
            return False

    def wait(self, poll: float = 0.1, timeout: float | None = None) -> bool:
        return step_until_done(self.step, poll, timeout, pause=self._pause)

    def _pause(self, seconds: float) -> None:
        """Sleep between steps, but wake as soon as the agent exits (the end of every run)."""
        try:
            self.proc.wait(seconds)
        except subprocess.TimeoutExpired:
            pass

    def stop(self, reason: str) -> None:
        """Stop every process of the run: SIGTERM the agent (it stops the ranks with the
        grace period), then SIGKILL anything still there."""
        with self._lock:
            if self.finished:
                return
            self.reason = self.reason or reason
            if self.proc.poll() is None:
                try:
                    os.kill(self.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                try:
                    self.proc.wait(self.spec.shutdown_grace + 5)
                except subprocess.TimeoutExpired:
                    procutil.kill_process_groups([self.proc.pid], signal.SIGKILL)
                    self.proc.wait()
            self._finalize()

    def _finalize(self) -> None:
        self.finished = True
        _ACTIVE.discard(self)
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        self._follow_attempts()
        if self.streamer:
            self.streamer.pump(final=True)
        self.kill_leftovers()
        if self.tracker is not None:        # tracking hook: logs, report, final MLflow status
            self.tracker.end(self.state)
        if self.standby:
            STANDBY.replenish(child_env())  # the next run's agent, importing torch meanwhile

    def kill_leftovers(self) -> list[int]:
        """Any rank (or a rank's child) still alive after its agent ended is killed now."""
        left = [p for p in self.rank_pids() if procutil.pid_alive(p)]
        if left:
            procutil.kill_process_groups(left, signal.SIGKILL)
        return left

    def rank_pids(self) -> list[int]:
        pids = set()
        status = self.run.status()
        pids.update(int(p) for p in (status.get("pids") or {}).values())
        for attempt in self.run.attempts():
            for info in self.run.attempt_dir(attempt).glob("rank*.info.json"):
                pid = (read_json(info, {}) or {}).get("pid")
                if pid:
                    pids.add(int(pid))
        return sorted(pids)

    def _follow_attempts(self) -> None:
        attempts = self.run.attempts()
        if not attempts or attempts[-1] == self._attempt_seen:
            return
        latest = attempts[-1]
        if self._attempt_seen >= 0 and self.streamer:
            history = self.run.status().get("history") or []
            why = ""
            if history:
                fails = history[-1].get("failures") or {}
                why = "; ".join(f"rank {r} {procutil.describe_exit(f.get('exitcode'))}"
                                for r, f in sorted(fails.items(), key=lambda kv: int(kv[0])))
            self.streamer.write(f"gpulaunch: attempt {self._attempt_seen} failed ({why}); "
                                f"restarting all ranks (attempt {latest} of "
                                f"{self.spec.max_restarts})\n")
        self._attempt_seen = latest
        if self.streamer:
            for r in range(self.spec.world_size):
                self.streamer.watch(r, self.run.rank_file(latest, r, "log"))

    # ------------------------------------------------------------------ results
    @property
    def state(self) -> str:
        if not self.finished:
            return "RUNNING" if self.proc is not None else "PENDING"
        if self.reason == "timeout":
            return "TIMED_OUT"
        if self.reason == "cancelled":
            return "CANCELLED"
        return {"SUCCEEDED": "SUCCEEDED"}.get(self.run.status().get("state"), "FAILED")

    def outcome(self) -> list:
        return report.raise_for_run(self.run, reason=self.reason, timeout=self.spec.timeout,
                                    world_size=self.spec.world_size,
                                    oom_kills_at_start=self._oom_start)


class _ActiveRuns:
    """Runs still going when the interpreter exits are stopped (the stdin pipe covers a
    caller that dies without running atexit). Any run with ``stop(reason)``: LocalRun, RayRun."""

    def __init__(self):
        self._runs: set = set()
        self._lock = threading.Lock()

    def add(self, run) -> None:
        with self._lock:
            self._runs.add(run)

    def discard(self, run) -> None:
        with self._lock:
            self._runs.discard(run)

    def stop_all(self) -> None:
        with self._lock:
            runs = list(self._runs)
        for run in runs:
            try:
                run.stop("cancelled")
            except Exception:
                pass


_ACTIVE = _ActiveRuns()

import atexit  # noqa: E402

atexit.register(_ACTIVE.stop_all)
