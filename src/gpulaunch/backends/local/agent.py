"""The node agent: ``python -m gpulaunch.backends.local.agent RUN_DIR [--node-rank N ...]``.

One agent runs per node. It is torchelastic's ``LocalElasticAgent`` (the machinery behind
torchrun: the worker environment contract, whole-group restarts, SIGTERM-then-SIGKILL
shutdown, error files), configured by the run directory, plus three things torchrun lacks:

* a rendezvous store bound to loopback on a single host (see ``rendezvous.py``);
* caller-death detection: the caller holds our stdin pipe; EOF means it died (even by SIGKILL),
  and we stop every rank;
* the hang watchdog's teardown: when a rank reports itself stuck, every local rank dumps its
  Python stack (SIGUSR1 -> faulthandler) before the group is killed.

It runs in its own process (not inside the caller) so that a notebook kernel never holds
signal handlers, stores or child processes of a run: cancelling a run is signalling one
process, and the caller stays responsive while ranks run (``submit``).
"""

from __future__ import annotations

import argparse
import inspect
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

from ...launch import procutil, worker
from ...launch.rundir import RunDir, read_json, write_json_atomic
from .rendezvous import BoundStaticRendezvous
from .standby import STARTUP_ENV_PREFIXES

log = logging.getLogger("gpulaunch.agent")


class RunDirLogs(LogsSpecs):
    """Per-rank log and error files at ``attempt<k>/rank<r>.*`` in the run directory."""

    def __init__(self, run: RunDir):
        super().__init__(log_dir=str(run.path))
        self.run = run

    @property
    def root_log_dir(self) -> str:
        return str(self.run.path)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        dest = LogsDest()
        for local_rank, env in envs.items():
            attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
            rank = int(env["RANK"])
            self.run.attempt_dir(attempt).mkdir(exist_ok=True)
            dest.stdouts[local_rank] = str(self.run.rank_file(attempt, rank, "log"))
            dest.stderrs[local_rank] = str(self.run.rank_file(attempt, rank, "stderr.log"))
            dest.error_files[local_rank] = str(self.run.rank_file(attempt, rank, "error.json"))
        return dest


class StatusWriter:
    """status.json: what the caller reads to follow the run (state, attempt, pids, failures)."""

    def __init__(self, run: RunDir, node_rank: int):
        self.run = run
        self.node_rank = node_rank
        self.lock = threading.Lock()
        self.data: dict = {"state": "STARTING", "attempt": 0, "pids": {}, "agent_pid": os.getpid(),
                           "node_rank": node_rank, "started": time.time(), "history": []}
        self.flush()

    def update(self, **kw) -> None:
        with self.lock:
            self.data.update(kw)
            self.flush()

    def flush(self) -> None:
        # One status file per node; node 0's is the run's (multi-node agents write their own).
        name = "status.json" if self.node_rank == 0 else f"status.node{self.node_rank}.json"
        write_json_atomic(self.run.path / name, self.data)


def _failures_to_json(failures) -> dict:
    out = {}
    for rank, f in failures.items():
        out[str(rank)] = {"local_rank": f.local_rank, "pid": f.pid, "exitcode": f.exitcode,
                          "error_file": f.error_file, "timestamp": f.timestamp,
                          "message": f.message}
    return out


class GpulaunchAgent(LocalElasticAgent):
    """LocalElasticAgent that reports its progress into the run directory."""

    def __init__(self, *a, status: StatusWriter, shutdown_grace: float, **kw):
        # Newer torch takes shutdown_timeout; older releases (2.11) hard-code 30 s in _shutdown.
        if "shutdown_timeout" in inspect.signature(LocalElasticAgent.__init__).parameters:
            kw["shutdown_timeout"] = max(1, int(round(shutdown_grace)))
        super().__init__(*a, **kw)
        self.status = status
        self.shutdown_grace = shutdown_grace
        self._last_result = None

    def _shutdown(self, death_sig=signal.SIGTERM, *args, **kwargs):
        # Stop the ranks with our grace period (SIGTERM, then SIGKILL) whatever the torch
        # version; torchelastic's own shutdown then finds them gone.
        if self._pcontext is not None:
            self._pcontext.close(death_sig, timeout=max(1, int(round(self.shutdown_grace))))
        return super()._shutdown(death_sig, *args, **kwargs)

    on_first_start = None   # called once, after the first group of ranks is running

    def _start_workers(self, worker_group):
        rdzv = worker_group.spec.rdzv_handler
        if isinstance(rdzv, BoundStaticRendezvous):
            rdzv.before_starting_ranks()         # multi-node: node 0 starts its ranks first
        if self._start_method != "fork":
            pids = super()._start_workers(worker_group)
        else:
            pids = self._fork_workers_behind_a_gate(worker_group)
        if isinstance(rdzv, BoundStaticRendezvous):
            rdzv.after_starting_ranks()
        if self.on_first_start is not None:
            callback, self.on_first_start = self.on_first_start, None
            callback()
        if self._start_method == "fork":
            _like_spawned_ranks(self._pcontext)
        attempt = worker_group.spec.max_restarts - self._remaining_restarts
        ranks = {w.local_rank: w.global_rank for w in worker_group.workers}
        self.status.update(state="RUNNING", attempt=attempt,
                           pids={str(ranks[lr]): pid for lr, pid in pids.items()})
        return pids

    def _fork_workers_behind_a_gate(self, worker_group):
        """Fork every rank, and only then let them run.

        A forked child inherits every lock of the agent in the state it had at the fork, and
        only the forking thread survives to release them. Threads of the agent do network work
        while ranks are forked one by one: the rendezvous stores' server threads accept the
        first ranks' connections and, for each, resolve the peer's address (``getnameinfo``),
        which holds glibc's resolver lock. A rank forked at that moment inherits that lock held
        and hangs forever in its own first ``getnameinfo`` (inside ``init_process_group``):
        measured here, 1 launch in 18 to 1 in 60 of 4 ranks on 2 cores, every rank then stuck
        in rendezvous (Accelerate's ``notebook_launcher`` forks the same way and hung likewise).
        So each rank waits on a pipe before doing anything, the agent closes it once the last
        fork is done, and no connection is accepted while a fork is in progress; the agent's
        own helper threads (the system-metrics sampler, which talks to MLflow) make no network
        call while it forks (``procutil.FORK_QUIET``: this matters on restarts, when the
        sampler is already running). (On a multi-
        node job node 0 also waits for every node's agent to connect first, and the other
        nodes start their ranks only after node 0's forks: ``rendezvous.py``.)"""
        read_end, write_end = os.pipe()
        os.environ[worker.FORK_GATE_ENV] = f"{read_end},{write_end}"
        # our own helper threads: no network call meanwhile (bounded: a tracking server that
        # hangs a request must not hold a restart for minutes)
        quiet = procutil.FORK_QUIET.acquire(timeout=10)
        try:
            return super()._start_workers(worker_group)
        finally:
            if quiet:
                procutil.FORK_QUIET.release()
            os.environ.pop(worker.FORK_GATE_ENV, None)
            os.close(write_end)            # EOF on the ranks' read ends: go
            os.close(read_end)
            self.status.update(forked_at=time.time())

    def _monitor_workers(self, worker_group):
        result = super()._monitor_workers(worker_group)
        if self._start_method == "fork" and result.state == WorkerState.HEALTHY:
            result = self._forked_success(worker_group) or result
        self._last_result = result
        return result

    def _forked_success(self, worker_group):
        """Forked ranks end with ``os._exit(0)`` (so a stray thread can never hang their exit)
        instead of handing a return value to torchelastic's queue; its MultiprocessContext
        would wait for that value forever. All ranks exited 0 = the group succeeded (results
        travel through the run directory anyway)."""
        procs = getattr(getattr(self._pcontext, "_pc", None), "processes", None)
        if not procs or any(p.exitcode != 0 for p in procs):
            return None
        self._pcontext.close()
        return RunResult(state=WorkerState.SUCCEEDED,
                         return_values={w.global_rank: None for w in worker_group.workers})

    def _restart_workers(self, worker_group):
        if self._last_result is not None and self._last_result.failures:
            history = self.status.data["history"] + [{
                "attempt": self.status.data["attempt"], "ended": time.time(),
                "failures": _failures_to_json(self._last_result.failures)}]
            self.status.update(state="RESTARTING", history=history)
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
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    poll, close = pcontext._poll, pcontext._close

    def poll_all():
        procs = getattr(getattr(pcontext, "_pc", None), "processes", None) or []
        # Exit codes before torchelastic's poll, and after it: on a failure that poll SIGTERMs
        # (later SIGKILLs) the survivors, so afterwards a death by those signals is ours, not
        # theirs; any other exit code is a rank that failed by itself in the same instant.
        exited = {lr: (p.pid, p.exitcode) for lr, p in enumerate(procs) if p.exitcode not in (None, 0)}
        result = poll()
        if result is not None and result.is_failed():
            ours = (None, 0, -signal.SIGTERM, -signal.SIGKILL)
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


def _watch_caller(stop_event: threading.Event) -> None:
    """The caller holds our stdin's write end. EOF = the caller is gone: stop everything."""
    try:
        # os.read, not sys.stdin.buffer.read: the buffered reader's lock would be held by this
        # thread at the moment we fork a rank, and a forked rank closing stdin would deadlock.
        while os.read(0, 1):
            pass
    except (OSError, ValueError):
        pass
    if not stop_event.is_set():
        os.kill(os.getpid(), signal.SIGTERM)


# Multi-node: after reporting a hang, how long a node agent keeps its ranks alive (stopped in
# place) so that the caller can have every *other* node dump its ranks' stacks too before it
# stops the job. A caller that never comes (gone, partitioned) costs this long, then we kill.
HANG_TEARDOWN_WAIT_S = 20.0


def _watch_hangs(run: RunDir, agent: GpulaunchAgent, status: StatusWriter,
                 stop_event: threading.Event, nnodes: int = 1) -> None:
    """Turn a rank's ``.stuck`` report into stack dumps of all local ranks and a teardown.

    On one host the teardown is immediate. In a multi-node job, killing our ranks at once
    would make the ranks of the other nodes fail on a closed connection before the caller could
    ask them for their stacks (the very stacks that show who waits for whom): so we report,
    then leave the teardown to the caller, within ``HANG_TEARDOWN_WAIT_S``."""
    while not stop_event.wait(0.5):
        attempt = status.data.get("attempt", 0)
        stuck = sorted(run.attempt_dir(attempt).glob("rank*.stuck"))
        if not stuck:
            continue
        report = read_json(stuck[0], {})
        pids = agent.current_pids()
        procutil.kill_pids(pids, signal.SIGUSR1)      # faulthandler: dump every thread's stack
        time.sleep(1.0)
        write_json_atomic(run.hang_json, {"detected_by": report.get("rank"), "attempt": attempt,
                                          "stuck_for": report.get("stuck_for"),
                                          "where": report.get("where"), "time": time.time(),
                                          "node_rank": status.node_rank})
        status.update(hang=True)
        if nnodes > 1:
            stop_event.wait(HANG_TEARDOWN_WAIT_S)
        procutil.kill_process_groups(pids, signal.SIGKILL)
        return


def _worker_env(launch: dict, run: RunDir, node_rank: int) -> None:
    """Environment every rank inherits, on top of what torchelastic sets per rank."""
    spec = launch["spec"]
    env = os.environ
    env["NODE_RANK"] = str(node_rank)          # Composer, Lightning and others read it
    env.setdefault("REPLICA_RANK", "0")
    env["PYTHONUNBUFFERED"] = "1"
    env["GPULAUNCH_RUN_DIR"] = str(run.path)
    env["GPULAUNCH_DEVICE"] = spec["device"]
    if spec.get("hang_timeout"):
        env["GPULAUNCH_HANG_TIMEOUT"] = str(spec["hang_timeout"])
    else:
        env.pop("GPULAUNCH_HANG_TIMEOUT", None)
    if spec["nproc_per_node"] > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = "1"              # what torchrun does; avoids oversubscription
    if launch.get("nnodes", 1) == 1:
        # Single host: collectives' sockets on loopback too (nothing listens publicly).
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        if spec["device"] == "cuda":
            env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    if spec["device"] == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""          # CPU workers: never touch a GPU by accident
    else:
        # NCCL flight recorder: a record of the last collectives, dumped on a watchdog timeout.
        env.setdefault("TORCH_FR_BUFFER_SIZE", "2000")  # older torch: TORCH_NCCL_TRACE_BUFFER_SIZE
        env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        env.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(run.path / "nccl_trace_rank_"))
    for k, v in spec.get("env", []):
        env[k] = v


def _wait_for_port(path: Path, timeout: float = 600.0) -> int:
    """Multi-node: node 0's store port, written by whoever learns it (the Ray node agent)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text().strip() if path.exists() else ""
        if text:
            return int(text)
        time.sleep(0.05)
    raise TimeoutError(f"node 0's rendezvous port did not arrive in {path} within {timeout:g} s")



def choose_start_method(spec: dict) -> tuple[str, str]:
    """fork (fast: ranks inherit our imported torch) unless something makes it unsafe.

    The usual objection to fork - a parent that initialised CUDA - cannot apply to the agent: it
    never touches a GPU (checked below anyway). ``GPULAUNCH_START_METHOD=spawn`` forces the old
    way: a fresh interpreter per rank, as torchrun does.
    """
    forced = os.environ.get("GPULAUNCH_START_METHOD", "").strip().lower()
    if forced in ("fork", "spawn"):
        return forced, "GPULAUNCH_START_METHOD"
    if forced:
        raise ValueError(f"GPULAUNCH_START_METHOD={forced!r}: use 'fork' or 'spawn'")
    if not hasattr(os, "fork"):
        return "spawn", "no fork on this platform"
    import torch
    if torch.cuda.is_initialized():
        return "spawn", "CUDA was initialised in the agent"
    startup = sorted(k for k, _ in spec.get("env", []) if k.startswith(STARTUP_ENV_PREFIXES))
    if startup:
        return "spawn", f"env= sets variables read at interpreter start: {', '.join(startup)}"
    return "fork", "default"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpulaunch-agent")
    p.add_argument("run_dir")
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--watch-stdin", action="store_true")
    p.add_argument("--warm", action="store_true", help="started ahead as a standby agent")
    a = p.parse_args(argv)

    run = RunDir(a.run_dir)
    launch = run.launch()
    spec = launch["spec"]
    node_rank = a.node_rank
    nnodes = int(launch.get("nnodes", 1))
    logging.basicConfig(level=logging.WARNING, format="gpulaunch-agent: %(message)s")
    # torchelastic logs every state change at INFO/WARNING; the caller reports what matters.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)

    status = StatusWriter(run, node_rank)
    status.update(warm_start=a.warm)
    stop_event = threading.Event()
    if a.watch_stdin:
        threading.Thread(target=_watch_caller, args=(stop_event,), daemon=True).start()

    node_tracking = None
    try:
        _worker_env(launch, run, node_rank)
        port = int(launch.get("port") or 0)
        if node_rank > 0 and launch.get("port_file"):
            port = _wait_for_port(Path(launch["port_file"]))
        # tracking hook (gpulaunch.tracking.node): MLflow ids for the ranks, system metrics
        if launch.get("tracking"):
            from ...tracking import node as _tracking_node
            node_tracking = _tracking_node.setup(launch, run, node_rank)
            if node_tracking is not None:
                status.update(mlflow_run_id=node_tracking.info["run_id"])
        rdzv = BoundStaticRendezvous(
            bind_host=launch.get("bind_host", "127.0.0.1"), port=port,
            connect_host=launch.get("master_addr"), node_rank=node_rank, nnodes=nnodes,
            run_id=run.run_id)
        status.update(master_port=rdzv.port)
        start_method, why = choose_start_method(spec)
        status.update(start_method=start_method, start_method_reason=why)
        if start_method == "fork":
            entry = [worker.fork_entry, str(run.path)]
            sys.stdout.flush()
            sys.stderr.flush()
        else:
            entry = [sys.executable, "-u", "-m", "gpulaunch.launch.worker", str(run.path)]
        wspec = WorkerSpec(role="rank", local_world_size=int(spec["nproc_per_node"]),
                           entrypoint=entry[0], args=tuple(entry[1:]), rdzv_handler=rdzv,
                           max_restarts=int(spec.get("max_restarts", 0)),
                           monitor_interval=0.05)   # how soon a rank's exit is seen
        agent = GpulaunchAgent(wspec, logs_specs=RunDirLogs(run), start_method=start_method,
                               shutdown_grace=float(spec["shutdown_grace"]),
                               exit_barrier_timeout=float(launch.get("exit_barrier_timeout", 300)),
                               status=status)
        if node_tracking is not None:
            agent.on_first_start = node_tracking.start_sampler
        if spec.get("hang_timeout"):
            threading.Thread(target=_watch_hangs, args=(run, agent, status, stop_event, nnodes),
                             daemon=True).start()
        result = agent.run()
    except SignalException as e:
        stop_event.set()
        if node_tracking is not None:
            node_tracking.stop()
        status.update(state="STOPPED", signal=signal.Signals(e.sigval).name, ended=time.time())
        return 128 + int(e.sigval)
    except BaseException as e:  # noqa: BLE001 - the caller must learn why
        stop_event.set()
        if node_tracking is not None:
            node_tracking.stop()
        status.update(state="AGENT_ERROR", error=f"{type(e).__name__}: {e}",
                      traceback=traceback.format_exc(), ended=time.time())
        traceback.print_exc()
        return 2
    stop_event.set()
    if node_tracking is not None:
        node_tracking.stop()
    if result.is_failed():
        status.update(state="FAILED", failures=_failures_to_json(result.failures),
                      ended=time.time())
        return 1
    status.update(state="SUCCEEDED", ended=time.time())
    return 0


def run_and_exit(argv: list[str] | None = None) -> None:
    """``main``, then leave without the interpreter's teardown of torch: everything of the run
    is over and recorded, and that teardown (up to seconds on a loaded machine) would all be on
    the caller's wait. Also the end of a standby agent (``standby.py``)."""
    code = main(argv)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


if __name__ == "__main__":
    run_and_exit()
