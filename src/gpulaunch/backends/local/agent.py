"""The node agent: ``python -m gpulaunch.backends.local.agent RUN_DIR [--node-rank N ...]``.

One agent runs per node. It is torchelastic's ``LocalElasticAgent`` (the machinery behind
torchrun: the worker environment contract, whole-group restarts, SIGTERM-then-SIGKILL
shutdown, error files; its private parts are in ``elastic_compat``), configured by the launch
record in the run directory, plus what torchrun lacks:

* a rendezvous store bound to loopback on a single host (``rendezvous.py``); with
  ``--nnodes MIN:MAX``, torch's dynamic rendezvous instead (``elastic_rendezvous.py``);
* caller-death detection: the caller holds our stdin pipe; EOF means it died (even by SIGKILL),
  and we stop every rank;
* the hang watchdog's teardown: when a rank reports itself stuck, every local rank dumps its
  Python stack (SIGUSR1 -> faulthandler) and, on GPUs, its NCCL flight record, before the group
  is killed;
* node hooks (``node_hooks``): side concerns of the launch (tracking) without naming them.

It runs in its own process (not inside the caller) so that a notebook kernel never holds
signal handlers, stores or child processes of a run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

from ...caller.failure_policy import Decision, FailurePolicy
from ...common import constants, preemption, procutil, redact
from ...common.records import (
    RECORD_VERSION,
    LaunchRecord,
    NodeState,
    NodeStatus,
)
from ...common.rundir import RunDir, read_json
from ...rank import worker
from . import elastic_rendezvous, hang
from . import peers as peer_watch
from .elastic_compat import ElasticAgent, exits_from
from .node_hooks import NodeHooks
from .rank_env import rank_env

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
            self.run.attempt_dir(attempt).mkdir(exist_ok=True, mode=0o700)
            dest.stdouts[local_rank] = str(self.run.rank_file(attempt, rank, "log"))
            dest.stderrs[local_rank] = str(self.run.rank_file(attempt, rank, "stderr.log"))
            dest.error_files[local_rank] = str(self.run.rank_file(attempt, rank, "error.json"))
        return dest


class StatusWriter:
    """This node's ``NodeStatus``, rewritten on every change (what the caller follows)."""

    def __init__(self, run: RunDir, node_rank: int):
        self.run = run
        self.lock = threading.Lock()
        self.status = NodeStatus(node_rank=node_rank, agent_pid=os.getpid(), started=time.time())
        self.flush()

    def update(self, **kw) -> None:
        with self.lock:
            self.status = dataclasses.replace(self.status, **kw)
            self.flush()

    def flush(self) -> None:
        self.run.write_status(self.status)


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


def _watch_hangs(run: RunDir, agent: ElasticAgent, status: StatusWriter, device: str,
                 stop_event: threading.Event, nnodes: int = 1) -> None:
    """Turn a rank's ``.stuck`` report into stack dumps (and NCCL traces) of all local ranks
    and a teardown.

    On one host the teardown is immediate. In a multi-node job, killing our ranks at once
    would make the ranks of the other nodes fail on a closed connection before the caller could
    ask them for their stacks (the very stacks that show who waits for whom): so we report,
    then leave the teardown to the caller, within ``HANG_TEARDOWN_WAIT_S``."""
    handled = -1      # every attempt is watched (with max_restarts, a hang restarts the group)
    while not stop_event.wait(0.5):
        attempt = agent.attempt
        if attempt <= handled:
            continue
        report = hang.stuck_report(run, attempt)
        if report is None:
            continue
        handled = attempt
        pids = agent.current_pids()
        hang.record_hang(run, attempt, report, pids, device=device,
                         node_rank=status.status.node_rank)
        status.update(hang=True)
        if nnodes > 1:
            stop_event.wait(constants.HANG_TEARDOWN_WAIT_S)
        procutil.kill_process_groups(pids, signal.SIGKILL)


def _drop_payload_when_loaded(run: RunDir, agent: ElasticAgent, spec,
                              stop_event: threading.Event) -> None:
    """Delete payload.pkl once every local rank of the LAST possible attempt has read it (each
    rank touches ``rank<r>.loaded`` after closing the file, so there is no race with a reader;
    an earlier attempt's ranks may be restarted and would need it again). The agent's end
    drops it in any case."""
    if not run.payload.exists():
        return
    last = spec.max_restarts + preemption.max_preemptions(os.environ)   # set by _worker_env
    while not stop_event.wait(0.2):
        attempt = agent.attempt
        if attempt >= last and run.loaded_count(attempt) >= spec.nproc_per_node:
            run.drop_payload()
            return


def _worker_env(record: LaunchRecord, run: RunDir, node_rank: int, extra: dict) -> None:
    """Environment every rank inherits, on top of what torchelastic sets per rank."""
    spec, env = record.spec, os.environ
    rank_env(env, spec, run_dir=run.path, node_rank=node_rank, nnodes=record.placement.nnodes)
    env[constants.AGENT_PID_ENV] = str(os.getpid())   # a rank orphaned at birth exits (worker.py)
    env.update(extra)
    # launch.json holds env= names only and masked arguments; the caller sent the values in
    # our environment (redact.py), taken out here so no rank inherits the whole bundle
    secrets = redact.take_secrets(env)
    values = secrets.get("env", {})
    for k, v in spec.env:
        if k in values:
            env[k] = values[k]
        elif v != redact.ENV_NOT_STORED:
            env[k] = v
    argv = secrets.get("entry_argv")
    if argv is not None and tuple(argv) != tuple(record.entry.argv):
        env[redact.ENTRY_ARGV_ENV] = json.dumps(argv)


def _wait_for_port(path: Path, timeout: float = constants.RENDEZVOUS_TIMEOUT_S) -> int:
    """Multi-node: node 0's store port, written by whoever learns it (the Ray node agent)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text().strip() if path.exists() else ""
        if text:
            return int(text)
        time.sleep(0.05)
    raise TimeoutError(f"node 0's rendezvous port did not arrive in {path} within {timeout:g} s")


def choose_start_method(spec) -> tuple[str, str]:
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
    startup = sorted(k for k, _ in spec.env if k.startswith(constants.STARTUP_ENV_PREFIXES))
    if startup:
        return "spawn", f"env= sets variables read at interpreter start: {', '.join(startup)}"
    return "fork", "default"


def _read_record(run: RunDir) -> LaunchRecord:
    data = read_json(run.launch_json)
    if not data:
        raise RuntimeError(f"no launch record in {run.path}")
    if data.get("version") != RECORD_VERSION:
        raise RuntimeError(f"{run.launch_json} has record version {data.get('version')}, this "
                           f"agent reads version {RECORD_VERSION}: the caller and the agent run "
                           "different gpulaunch versions. Use one installation for both.")
    return LaunchRecord.from_data(data)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpulaunch-agent")
    p.add_argument("run_dir")
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--watch-stdin", action="store_true")
    p.add_argument("--warm", action="store_true", help="started ahead as a standby agent")
    a = p.parse_args(argv)

    run = RunDir(a.run_dir)
    node_rank = a.node_rank
    logging.basicConfig(level=logging.WARNING, format="gpulaunch-agent: %(message)s")
    # torchelastic logs every state change at INFO/WARNING; the caller reports what matters.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)

    status = StatusWriter(run, node_rank)
    status.update(warm_start=a.warm)
    stop_event = threading.Event()
    if a.watch_stdin:
        threading.Thread(target=_watch_caller, args=(stop_event,), daemon=True).start()

    hooks = rdzv = None
    peers: list[peer_watch.PeerWatch] = []     # gpulaunch run --nnodes: fail-stop
    try:
        record = _read_record(run)
        spec, placement = record.spec, record.placement
        hooks = NodeHooks(record, run, node_rank)
        _worker_env(record, run, node_rank, hooks.env())
        status.update(extensions=hooks.status_fields())
        port = placement.master_port
        if node_rank > 0 and placement.master_port_file:
            port = _wait_for_port(Path(placement.master_port_file))
        rdzv = elastic_rendezvous.make(placement, node_rank=node_rank, port=port,
                                       run_id=placement.rdzv_id or run.run_id,
                                       join_timeout=spec.start_timeout)
        status.update(master_port=rdzv.port)
        start_method, why = choose_start_method(spec)
        status.update(start_method=start_method, start_method_reason=why)
        if start_method == "fork":
            entry = [worker.fork_entry, str(run.path)]
            sys.stdout.flush()
            sys.stderr.flush()
        else:
            entry = [sys.executable, "-u", "-m", "gpulaunch.rank.worker", str(run.path)]
        wspec = WorkerSpec(role="rank", local_world_size=spec.nproc_per_node,
                           entrypoint=entry[0], args=tuple(entry[1:]), rdzv_handler=rdzv,
                           max_restarts=spec.max_restarts,
                           monitor_interval=constants.AGENT_MONITOR_S)
        first = [True]

        def on_peer_failure(failure):
            status.update(peer_failure=failure)
            os.kill(os.getpid(), signal.SIGTERM)    # torchelastic stops the ranks, as on cancel

        def on_started(pids, attempt, forked_at):
            rdzv.after_starting_ranks()
            if first[0]:
                first[0] = False
                hooks.on_ranks_started()
                if placement.stop_on_peer_failure and placement.nnodes > 1:
                    peers.append(peer_watch.watch(rdzv.connect_host, rdzv.port, node_rank,
                                                  placement.nnodes, on_peer_failure))
            status.update(state=NodeState.RUNNING, attempt=attempt, pids=pids,
                          forked_at=forked_at, **layout)

        layout: dict = {}      # this attempt's world (--nnodes MIN:MAX: from the rendezvous)

        def before_start(wg):
            rdzv.before_starting_ranks()
            layout.update(world_size=wg.group_world_size * spec.nproc_per_node,
                          nnodes=wg.group_world_size, group_rank=wg.group_rank)
            if placement.elastic:           # what Composer / Lightning read: the round's
                os.environ["NODE_RANK"] = str(wg.group_rank)

        # torchelastic's loop restarts (the budget: spec.max_restarts); the history is the
        # same FailurePolicy's as the pool's and Ray's
        policy = FailurePolicy(spec.max_restarts, preemption.max_preemptions(os.environ))
        policy.history = list(status.status.history)

        def preempted(attempt):
            """Did this attempt stop for a preemption notice (its checkpoint saved)? Then
            restart it under max_preemptions, or stop when the notice allows no restart."""
            saved = preemption.read_saved(run.path, attempt)
            if saved is None:
                return None
            if saved["notice"].get("restart") and policy.decide(attempt, preempted=True) \
                    is not Decision.GIVE_UP:
                return "restart"
            return "stop"

        def on_restart(attempt, exits):
            saved = preemption.read_saved(run.path, attempt)
            cause = (f"preempted: checkpoint of step {saved['step']} saved in "
                     f"{saved['checkpoint']}" if saved else "")
            rec = policy.record(attempt, cause, exits, preempted=saved is not None)
            policy.history[-1] = dataclasses.replace(
                rec, world_size=layout.get("world_size", 0), nnodes=layout.get("nnodes", 0),
                membership=placement.elastic and not exits and saved is None)
            if saved is not None:
                preemption.archive_notice(run.path, attempt)
            status.update(state=NodeState.RESTARTING, history=list(policy.history))

        agent = ElasticAgent(wspec, logs_specs=RunDirLogs(run), start_method=start_method,
                             shutdown_grace=spec.shutdown_grace,
                             before_start=before_start,
                             on_started=on_started, on_restart=on_restart,
                             first_attempt=placement.first_attempt, preempted=preempted,
                             free_membership_restarts=placement.elastic)
        if spec.hang_timeout:
            threading.Thread(target=_watch_hangs, daemon=True,
                             args=(run, agent, status, spec.device, stop_event,
                                   placement.nnodes)).start()
        threading.Thread(target=_drop_payload_when_loaded, daemon=True,
                         args=(run, agent, spec, stop_event)).start()
        result = agent.run()
    except SignalException as e:
        stop_event.set()
        run.drop_payload()
        if hooks is not None:
            hooks.stop()
        if peers and peers[0].peer is not None:     # another node failed: so did the job
            status.update(state=NodeState.FAILED, peer_failure=peers[0].peer,
                          ended=time.time())
            peers[0].linger()
            return 1
        status.update(state=NodeState.STOPPED, signal=signal.Signals(e.sigval).name,
                      ended=time.time())
        return 128 + int(e.sigval)
    except BaseException as e:  # noqa: BLE001 - the caller must learn why
        stop_event.set()
        _close_elastic(rdzv)
        run.drop_payload()
        if hooks is not None:
            hooks.stop()
        status.update(state=NodeState.AGENT_ERROR, error=f"{type(e).__name__}: {e}",
                      traceback=traceback.format_exc(), ended=time.time())
        traceback.print_exc()
        return 2
    stop_event.set()
    _close_elastic(rdzv)
    run.drop_payload()   # no rank of this node will start again
    hooks.stop()
    if result.is_failed():
        exits = exits_from(result.failures)
        if peers:
            ours, collateral = peer_watch.own_failure(run, agent.attempt, exits, node_rank)
            stood = peers[0].publish(ours, collateral=collateral)
            status.update(peer_failure=stood if stood.node_rank != node_rank else None)
        status.update(state=NodeState.FAILED, failures=exits, ended=time.time())
        if peers:
            peers[0].linger()
        return 1
    status.update(state=NodeState.SUCCEEDED, ended=time.time())
    return 0


def _close_elastic(rdzv) -> None:
    """The job ended here (not by a signal): close an elastic rendezvous, as torchrun does, so
    no node joins a finished job; a signal leaves it open for a node that replaces this one."""
    if isinstance(rdzv, elastic_rendezvous.ElasticRendezvous):
        rdzv.shutdown()


def run_and_exit(argv: list[str] | None = None) -> None:
    """``main``, then leave without the interpreter's teardown of torch: everything of the run
    is over and recorded, and that teardown (up to seconds on a loaded machine) would all be on
    the caller's wait. Also the end of a standby agent (``standby_process.py``)."""
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
