"""Caller side of a multi-node run on Ray: place the job, start one node agent per node,
follow them, tear everything down, and report exactly as a local run does.

The caller keeps an ordinary run directory (``~/.gpulaunch/runs/<id>``) that mirrors the
union of the nodes' run directories: every rank's log, info, result and error files arrive
there through the node agents' ``poll()``. Logs stream from it (``[node n rank r]`` lines),
``RunHandle.logs()`` reads it, and the outcome is built from it by the same ``report`` code as
a single-host run: the rank's own exception type with its remote traceback, rank and host.

Teardown: the first node to end in failure (or to vanish) stops the whole job: every other
node's agent gets SIGTERM then SIGKILL through its actor, the actors are killed and the
placement group removed. A node that stops answering is declared lost after
``NODE_LOST_AFTER`` seconds, so a dead machine never hangs the caller.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time

from ... import errors
from . import calls
from ...launch import rundir
from ...launch.logstream import LogStreamer
from ...launch.report import raise_for_run
from ...launch.rundir import RunDir, hostname, write_json_atomic
from ...launch.spec import LaunchSpec
from ..local.launcher import _ACTIVE, step_until_done   # shared with local runs
from . import placement
from .cluster import RayCluster, _has_local_paths, connect
from .node_agent import NodeAgent

POLL_INTERVAL = 0.25
NODE_LOST_AFTER = 30.0       # a node whose agent does not answer for this long is lost
START_TIMEOUT = 180.0        # actors up and agents started (imports torch on each node)

_TERMINAL = ("SUCCEEDED", "FAILED", "AGENT_ERROR", "STOPPED")


class RayRun:
    """One job on a Ray cluster. Same surface as ``LocalRun``: start, step, wait, stop,
    state, finished, outcome, run (the caller's run directory), spec."""

    def __init__(self, spec: LaunchSpec, payload: bytes, entry: dict, *, label: str,
                 cluster: RayCluster | None = None, stream: bool = True, write=None,
                 tracking=None):
        if spec.max_restarts:
            raise errors.ConfigurationError(
                "max_restarts is not supported with remote=True yet: a restart would have to "
                "re-form the group on every node at once. Use max_restarts=0 and resume from a "
                "checkpoint in your function.")
        self.cluster = RayCluster.coerce(cluster)
        self.requested = spec
        self.spec = spec                 # replaced by the placed layout in start()
        self.payload = payload
        self.entry = entry
        self.label = label
        self.reason: str | None = None
        self.finished = False
        self.stream = stream
        self.write = write
        self.streamer: LogStreamer | None = None
        self.run: RunDir | None = None
        self.layout: placement.Layout | None = None
        self.actors: list = []
        self.nodes: list[dict] = []       # info() of each node agent, by node rank
        self.pg = None
        self.lost: dict | None = None     # {"node_rank", "why"} when a node vanished
        self.disconnected = False         # this process's Ray connection ended mid-run
        self._stacks_asked = False        # a node reported a hang: every node dumped stacks
        self._lock = threading.RLock()
        self._cursors: list[dict] = []
        self._node_status: list[dict] = []
        self._node_done: list[bool] = []
        self._last_answer: list[float] = []
        self._pending: list = []
        self._deadline: float | None = None
        self._ray = None
        self.timings: dict[str, float] = {}   # seconds since start() for each phase
        self.tracking = tracking          # gpulaunch.tracking settings (None: the default)
        self.tracker = None               # the call's MLflow run, opened in start()

    def _mark(self, phase: str) -> None:
        self.timings[phase] = round(time.monotonic() - self._t0, 3)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "RayRun":
        self._t0 = time.monotonic()
        ray = self._ray = connect(self.cluster)
        self._mark("connected")
        layout = placement.plan(placement.cluster_nodes(ray), gpus=self.requested.nproc_per_node,
                                gpu_type=self.requested.gpu_type,
                                gpus_per_node=self.cluster.gpus_per_node,
                                autoscaling=self.cluster.autoscaling)
        self.layout = layout
        self.spec = dataclasses.replace(self.requested, nproc_per_node=layout.nproc_per_node,
                                        nnodes=layout.nnodes, device=layout.device)
        self.run = rundir.create(self.label)
        # tracking hook: the MLflow run is created in a thread while the job is placed and
        # the node agents start; the agents get its ids when they start their ranks.
        from ...tracking.caller import begin as _begin_tracking
        self.tracker = _begin_tracking(self.tracking, self.run, label=self.label,
                                       spec=self.spec, entry=self.entry)
        self._write_launch()
        self._write_status("PLACING")
        timeout = self.cluster.placement_timeout if not self.cluster.autoscaling \
            else max(self.cluster.placement_timeout, 600.0)
        try:
            self.pg, _ = placement.reserve(ray, layout, timeout=timeout,
                                           name=f"gpulaunch-{self.run.run_id}")
            self._mark("placed")
            self._start_nodes()
            self._mark("started")
        except BaseException as e:
            self._teardown()
            self.finished = True
            self._write_status("AGENT_ERROR")
            if self.tracker is not None:
                self.tracker.end("CANCELLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
            if isinstance(e, (errors.GpulaunchError, KeyboardInterrupt)):
                raise
            raise errors.LaunchError(
                f"The job's node agents could not be started on the Ray cluster: "
                f"{type(e).__name__}: {e}\nRun directory: {self.run.path}",
                run_dir=str(self.run.path)) from e
        if self.stream:
            show = self.spec.shows_rank
            per = layout.nproc_per_node
            self.streamer = LogStreamer(prefix=lambda r: f"[node {r // per} rank {r}] ",
                                        show=show, write=self.write)
            for r in range(self.spec.world_size):
                self.streamer.watch(r, self.run.rank_file(0, r, "log"))
        if self.spec.timeout is not None:
            self._deadline = time.monotonic() + self.spec.timeout
        self._write_status("RUNNING")
        _ACTIVE.add(self)
        if not os.environ.get("GPULAUNCH_QUIET"):
            sys.stdout.write(f"gpulaunch: run {self.run.run_id}: {layout.describe()} on the Ray "
                             f"cluster ({'gloo' if layout.device == 'cpu' else 'nccl'}); "
                             f"rendezvous on node 0 at {self.master['addr']}\n")
            sys.stdout.flush()
        return self

    def _start_nodes(self) -> None:
        ray = self._ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        layout = self.layout
        remote_cls = ray.remote(NodeAgent)
        extra = {}
        if self.cluster.runtime_env and not _has_local_paths(self.cluster.runtime_env):
            # URIs, pip, env_vars: per actor. Local paths were uploaded at ray.init (job level).
            extra["runtime_env"] = self.cluster.runtime_env
        for i in range(layout.nnodes):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                        placement_group_bundle_index=i)
            actor = remote_cls.options(scheduling_strategy=strategy, max_restarts=0,
                                       max_concurrency=4, name=None,
                                       **layout.actor_options(), **extra).remote(
                                           self.run.run_id, i)
            self.actors.append(actor)
        self.nodes = ray.get([a.info.remote() for a in self.actors], timeout=START_TIMEOUT)
        self._mark("actors_up")
        payload_ref = ray.put(self.payload)
        common = (self.spec, self.entry, self.label)
        tracking = self._tracking_fields()
        # Every node's agent starts at once (each imports torch); node 0 binds its store on
        # its cluster IP with a port chosen there, and the others learn it when it is known.
        head = self.nodes[0]
        started = [self.actors[0].start.remote(*common, payload_ref, layout.nnodes, None, 0,
                                               tracking)]
        started += [a.start.remote(*common, payload_ref, layout.nnodes, head["ip"], None,
                                   tracking)
                    for a in self.actors[1:]]
        port = ray.get(started[0], timeout=START_TIMEOUT)["master_port"]
        self._mark("node0_store_up")
        ray.get([a.set_master_port.remote(port) for a in self.actors[1:]] + started[1:],
                timeout=START_TIMEOUT)
        n = layout.nnodes
        self._cursors = [{} for _ in range(n)]
        self._node_status = [{} for _ in range(n)]
        self._node_done = [False] * n
        self._last_answer = [time.monotonic()] * n
        self._pending = [None] * n
        self.master = {"addr": head["ip"], "port": port}
        self._write_launch()

    def _tracking_fields(self) -> dict | None:
        """The MLflow run's ids for the node agents (the caller made the run meanwhile).

        Nodes cannot see the caller's run directory, so they are handed the ids themselves.
        A store that is a file on the caller's machine (the default sqlite database) is only
        reachable from other machines through shared storage: say so, once, up front."""
        if self.tracker is None:
            return None
        info = self.tracker.wait_ready()
        if not info or not info.get("run_id"):
            return None
        uri = info["tracking_uri"]
        here = hostname()
        elsewhere = sorted({n.get("host") for n in self.nodes if n.get("host") != here})
        if elsewhere and _is_local_store(uri):
            from ...tracking.caller import warn_once
            warn_once(f"the store {uri} is a file on {here}",
                      f"ranks on {', '.join(map(str, elsewhere))} can write to it only if that "
                      "path is shared storage mounted at the same place; for multi-node runs "
                      "point MLFLOW_TRACKING_URI at a tracking server (mlflow server ...)")
        return info

    def step(self) -> bool:
        """Collect what the nodes have, stream logs, enforce the timeout; True once ended."""
        with self._lock:
            if self.finished:
                return True
            if not self._connected():
                self._finish(None)
                return True
            try:
                self._poll_nodes()
            except (Exception, SystemExit):
                # ray.shutdown() in another thread while this poll waits in ray.wait(): Ray ends
                # the call with an error, or with SystemExit from its core worker (seen in CI).
                if not self._disconnecting():
                    raise
                self._finish(None)
                return True
            if "ranks_spawned" not in self.timings and self._node_status and all(
                    (st or {}).get("state") in ("RUNNING",) + _TERMINAL
                    for st in self._node_status):
                self._mark("ranks_spawned")
            if self.streamer:
                self.streamer.pump()
            if not self._stacks_asked and any(s.get("hang") for s in self._node_status):
                self._dump_every_nodes_stacks()
                self._finish(None)
                return True
            failed = [i for i, s in enumerate(self._node_status)
                      if self._node_done[i] and s.get("state") != "SUCCEEDED"]
            if self.lost or failed:
                self._finish(None)
                return True
            if all(self._node_done):
                self._finish(None)
                return True
            if self._deadline is not None and time.monotonic() > self._deadline:
                self._finish("timeout")
                return True
            self._write_status("RUNNING")
            return False

    def wait(self, poll: float = POLL_INTERVAL, timeout: float | None = None) -> bool:
        return step_until_done(self.step, poll, timeout)

    def stop(self, reason: str) -> None:
        with self._lock:
            if not self.finished:
                self._finish(reason)

    # ------------------------------------------------------------------ following the nodes
    def _poll_nodes(self, wait: float = 2.0) -> None:
        ray = self._ray
        for i, actor in enumerate(self.actors):
            if self._node_done[i] or self._pending[i] is not None:
                continue
            self._pending[i] = calls.call(actor.poll, self._cursors[i])
        refs = [r for r in self._pending if r is not None]
        if not refs:
            return
        ready, _ = calls.wait(ray, refs, num_returns=len(refs), timeout=wait)
        now = time.monotonic()
        for i, ref in enumerate(self._pending):
            if ref is None:
                continue
            if ref not in ready:
                if now - self._last_answer[i] > NODE_LOST_AFTER:
                    self._mark_lost(i, f"its node agent did not answer for {NODE_LOST_AFTER:g} s")
                continue
            self._pending[i] = None
            self._last_answer[i] = now
            try:
                answer = calls.get(ray, ref)
            except Exception as e:  # RayActorError, ActorDiedError, NodeDiedError...
                self._mark_lost(i, _ray_error_text(e))
                continue
            self._absorb(i, answer)

    def _dump_every_nodes_stacks(self) -> None:
        """A node's watchdog declared a hang: before anything is stopped, every other node's
        ranks write their stacks (the node that saw it already did, and waits for us)."""
        self._stacks_asked = True
        refs = [calls.call(a.dump_stacks) for i, a in enumerate(self.actors)
                if not self._node_done[i] and not self._node_status[i].get("hang")]
        if refs:
            calls.wait(self._ray, refs, num_returns=len(refs), timeout=10)

    def _absorb(self, i: int, answer: dict) -> None:
        for rel, (kind, mark, data) in answer["files"].items():
            path = self.run.path / rel
            if rel == "hang.json" and path.exists():
                # several nodes' watchdogs may fire; the report names the first one seen
                self._cursors[i][rel] = mark
                continue
            path.parent.mkdir(exist_ok=True)
            if kind == "append":
                with open(path, "ab") as f:
                    if f.tell() != mark:      # never duplicate or tear a log
                        f.truncate(mark)
                        f.seek(mark)
                    f.write(data)
                self._cursors[i][rel] = mark + len(data)
            else:
                if rel.endswith(".info.json"):
                    data = self._label_host(i, data)
                tmp = path.with_name(f".{path.name}.mirror")
                tmp.write_bytes(data)
                os.replace(tmp, path)
                self._cursors[i][rel] = mark
        self._node_status[i] = answer["status"]
        if answer["done"] and not answer["files"]:
            # drained: the agent has ended and every file it left has arrived
            self._node_done[i] = True
            if answer.get("agent_tail") and answer["status"].get("state") not in _TERMINAL:
                self._node_status[i] = dict(answer["status"], state="AGENT_ERROR",
                                            error="the node's agent stopped unexpectedly",
                                            traceback=answer["agent_tail"])

    def _label_host(self, i: int, data: bytes) -> bytes:
        """A rank's host as the caller reports it: host name, node rank and cluster IP (the
        host name alone is ambiguous on clusters of look-alike machines or pods)."""
        import json
        try:
            info = json.loads(data)
        except ValueError:
            return data
        node = self.nodes[i] if i < len(self.nodes) else {}
        info["node_rank"] = i
        info["host"] = f"{info.get('host', '?')}, node {i} @ {node.get('ip', '?')}"
        return json.dumps(info).encode()

    def _mark_lost(self, i: int, why: str) -> None:
        self._node_done[i] = True
        self._pending[i] = None
        if self.lost is None:
            self.lost = {"node_rank": i, "why": why, "time": time.time()}

    # ------------------------------------------------------------------ ending
    def _connected(self) -> bool:
        """Is this process still connected to the Ray cluster? After ``ray.shutdown()`` (or a
        lost head) any actor call would silently ``ray.init()`` a *new* connection (Ray's
        auto-init), to a cluster that may be gone: never do that. The job's actors are owned by
        this driver, so Ray itself kills them (and with them the ranks) when it disconnects."""
        if self.disconnected:
            return False
        if self._ray is not None and not self._ray.is_initialized():
            self.disconnected = True
            return False
        return True

    def _disconnecting(self, within: float = 5.0) -> bool:
        """After a Ray call failed: is this because the connection is ending? ``ray.shutdown()``
        marks the connection closed only at its end, so give it a few seconds to get there."""
        deadline = time.monotonic() + within
        while self._connected():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def _finish(self, reason: str | None) -> None:
        self.reason = self.reason or reason
        self._mark("ended")
        if self.lost is not None and not self.disconnected:
            # A node that stopped answering just as ray.shutdown() ran was not lost: the
            # connection ended. Let the shutdown finish so that the error says so.
            self._disconnecting(within=2.0)
        if self._connected():
            try:
                self._stop_nodes()
                self._teardown()
            except (Exception, SystemExit):
                if not self._disconnecting():
                    raise
        self._mark("torn_down")
        if self.streamer:
            self.streamer.pump(final=True)
        self.finished = True
        _ACTIVE.discard(self)
        try:
            self._write_status(self._final_state())
        finally:
            if self.tracker is not None:    # tracking hook: logs, report, final MLflow status
                self.tracker.end(self.state)

    def _stop_nodes(self) -> None:
        """Stop every node still running, then collect its last files (logs, errors)."""
        ray = self._ray
        live = [i for i in range(len(self.actors)) if not (self.lost and
                                                            self.lost["node_rank"] == i)]
        grace = self.spec.shutdown_grace + 15
        stops = {i: calls.call(self.actors[i].stop) for i in live}
        for i, ref in stops.items():
            try:
                calls.get(ray, ref, timeout=grace)
            except (Exception, SystemExit) as e:
                if not self._node_done[i]:       # it was still running and did not answer
                    self._mark_lost(i, _ray_error_text(e))
        for i in live:
            if self.lost and self.lost["node_rank"] == i:
                continue
            try:
                # drain: after stop() the node's files are final
                for _ in range(8):
                    answer = calls.get(ray, calls.call(self.actors[i].poll, self._cursors[i]), timeout=30)
                    done_before = answer["done"] and not answer["files"]
                    self._absorb(i, answer)
                    if done_before:
                        break
            except (Exception, SystemExit) as e:
                if self.lost is None and not self._node_done[i]:
                    self._mark_lost(i, _ray_error_text(e))

    def _teardown(self) -> None:
        ray = self._ray
        if ray is None or not self._connected():
            return
        for actor in self.actors:
            try:
                calls.kill(ray, actor)
            except (Exception, SystemExit):
                pass
        if self.pg is not None:
            try:
                from ray.util.placement_group import remove_placement_group
                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None

    # ------------------------------------------------------------------ run directory
    def _write_launch(self) -> None:
        write_json_atomic(self.run.launch_json, {
            "spec": dataclasses.asdict(self.spec), "entry": self.entry, "label": self.label,
            "backend": "ray", "address": self.cluster.resolved_address(),
            "nnodes": self.spec.nnodes, "world_size": self.spec.world_size,
            "layout": dataclasses.asdict(self.layout) if self.layout else None,
            "nodes": self.nodes, "master": getattr(self, "master", None),
            "caller_pid": os.getpid(), "host": hostname(), "cwd": os.getcwd(),
            "argv": sys.argv, "started": time.time()})

    def _merged_status(self, state: str) -> dict:
        failures: dict = {}
        history: list = []
        for s in self._node_status:
            failures.update(s.get("failures") or {})
        agent_errors = [s for s in self._node_status if s.get("state") == "AGENT_ERROR"]
        out = {"state": state, "backend": "ray", "attempt": 0, "pids": {},
               "timings": self.timings,
               "failures": failures, "history": history,
               "nodes": [{"node_rank": i, "ip": n.get("ip"), "node_id": n.get("node_id"),
                          "host": n.get("host"), "actor_pid": n.get("actor_pid"),
                          "agent_pid": _get(self._node_status, i, "agent_pid"),
                          "state": _get(self._node_status, i, "state")}
                         for i, n in enumerate(self.nodes)]}
        if agent_errors:
            out["error"] = agent_errors[0].get("error")
            out["traceback"] = agent_errors[0].get("traceback", "")
        if self.lost:
            out["lost"] = self.lost
        return out

    def _final_state(self) -> str:
        states = [s.get("state") for s in self._node_status]
        if self.disconnected:
            return "DISCONNECTED"
        if self.lost:
            return "NODE_LOST"
        if states and all(s == "SUCCEEDED" for s in states):
            return "SUCCEEDED"
        if any(s == "FAILED" for s in states):
            return "FAILED"
        if any(s == "AGENT_ERROR" for s in states):
            return "AGENT_ERROR"
        return "STOPPED"

    def _write_status(self, state: str) -> None:
        write_json_atomic(self.run.status_json, self._merged_status(state))

    # ------------------------------------------------------------------ results
    @property
    def state(self) -> str:
        if not self.finished:
            return "RUNNING" if self.actors else "PENDING"
        if self.reason == "timeout":
            return "TIMED_OUT"
        if self.reason == "cancelled":
            return "CANCELLED"
        return "SUCCEEDED" if self.run.status().get("state") == "SUCCEEDED" else "FAILED"

    def outcome(self) -> list:
        if self.disconnected and self.reason is None:
            raise errors.LaunchError(
                f"The connection to the Ray cluster ended while run {self.run.run_id} was going "
                f"(ray.shutdown() was called, or the head node went away). The job's node "
                f"agents belonged to this connection, so Ray stopped them with it. Run "
                f"directory: {self.run.path}", run_dir=str(self.run.path))
        if self.lost and self.reason is None:
            raise self._lost_error()
        try:
            return raise_for_run(self.run, reason=self.reason, timeout=self.spec.timeout,
                                 world_size=self.spec.world_size)
        except BaseException as e:
            rank = getattr(e, "rank", None)
            if isinstance(rank, int):
                try:
                    e.node_rank = rank // self.spec.nproc_per_node
                except Exception:
                    pass
            raise

    def _lost_error(self) -> errors.NodeLostError:
        i = self.lost["node_rank"]
        node = self.nodes[i] if i < len(self.nodes) else {}
        per = self.spec.nproc_per_node
        ranks = f"ranks {i * per}-{(i + 1) * per - 1}" if per > 1 else f"rank {i * per}"
        others = [f"rank {r}: {(f.get('message') or '').splitlines()[0][:120] if f.get('message') else 'exit ' + str(f.get('exitcode'))}"
                  for r, f in sorted((self.run.status().get("failures") or {}).items(),
                                     key=lambda kv: int(kv[0]))]
        also = ("\nAfter it, these ranks failed too (a consequence): " + "; ".join(others)) \
            if others else ""
        return errors.NodeLostError(
            f"Node {i} of the job (Ray node {str(node.get('node_id', '?'))[:12]}, ip "
            f"{node.get('ip', '?')}, host {node.get('host', '?')}; {ranks}) was lost: "
            f"{self.lost['why']}. Every other node was stopped.{also}\n"
            f"Run directory: {self.run.path}",
            rank=i * per, host=node.get("host"), run_dir=str(self.run.path), node_rank=i)

    def all_pids(self) -> dict[int, list[int]]:
        """Every process of the job on each node (tests check that none survives)."""
        ray = self._ray
        out = {}
        for i, a in enumerate(self.actors):
            try:
                out[i] = ray.get(a.pids.remote(), timeout=10)
            except Exception:
                out[i] = []
        return out


def _is_local_store(uri: str) -> bool:
    """A store that lives in this machine's file system (not a server)."""
    if "://" in uri:
        return uri.split("://", 1)[0] in ("sqlite", "file")
    return not uri.startswith("databricks")      # a bare path is a file store


def _get(statuses: list[dict], i: int, key: str):
    return (statuses[i] or {}).get(key) if i < len(statuses) else None


def _ray_error_text(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = next((line for line in text if line.strip()), "")
    return f"{type(e).__name__}: {first[:300]}"
