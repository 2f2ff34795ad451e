"""Caller side of a multi-node run on Ray (``Run`` protocol): place the job, start one node agent
per node, follow them, tear everything down, and report exactly as a local run does.

    start:  connect -> plan the layout -> reserve a placement group -> start the node actors
            (node 0 opens the rendezvous store; the others learn its port)
    poll:   ask every node (``node_handle.poll_all``; files land in the caller's run directory,
            ``mirror``) -> decide: done / failed / lost / hung / timed out -> tear down
    end:    stop every node's ranks, drain their last files, kill the actors, remove the group
    restart (max_restarts): a failed attempt is stopped on every node as at the end, the group
            kept, and the next attempt started on every node (``restarts``: the data flow)

The caller's run directory mirrors the union of the nodes' run directories, so logs stream
from it (``[node n rank r]``), ``RunHandle.logs()`` reads it, and the outcome is built from it
(``caller.collect``), typed, as for a single host; ``job.json`` records the job's progress.
"""

from __future__ import annotations

import dataclasses
import os
import time

from ... import errors
from ...caller import collect
from ...caller.controller import RunController
from ...caller.failure_policy import Decision, FailurePolicy
from ...caller.logstream import LogStreamer
from ...caller.outcome import LostNode
from ...common import constants
from ...common.records import JobStatus, LaunchRecord, RunState, StopReason
from ...common.rundir import RunDir, hostname, write_json_atomic
from . import calls, placement, restarts
from .cluster import RayCluster, connect, has_local_paths
from .connection import Connection
from .node_agent import NodeAgent
from .node_handle import NodeHandle, drain_all, poll_all, stop_all


class RayRun(RunController):
    """One job on a Ray cluster (its lifecycle: ``RunController``)."""

    poll_interval = constants.POLL_RAY_S

    def __init__(self, record: LaunchRecord, run: RunDir, payload: bytes, *, cluster=None,
                 callbacks=None, stream: bool = True, write=None):
        super().__init__(record, run, callbacks=callbacks)   # spec: the placed layout, later
        self.payload = payload
        self.cluster = RayCluster.coerce(cluster)
        self.stream, self.write = stream, write
        self.streamer: LogStreamer | None = None
        self.layout: placement.Layout | None = None
        self.nodes: list[NodeHandle] = []
        self.pg = None
        self.conn: Connection | None = None
        self.master: dict | None = None
        self.timings: dict[str, float] = {}     # seconds since start() for each phase
        self._stacks_asked = False
        self.attempt = 0                        # the job's attempt (max_restarts: restarts.py)
        self.policy = FailurePolicy(record.spec.max_restarts)   # restart or give up
        self._payload_ref = None
        self._extensions: dict | None = None
        self._errors = restarts.ErrorWatch(run, enabled=not record.spec.debug)
        self._t0 = time.monotonic()

    def _mark(self, phase: str) -> None:
        self.timings[phase] = round(time.monotonic() - self._t0, 3)

    def describe(self) -> str:
        device = "gloo" if self.layout.device == "cpu" else "nccl"
        return (f"{self.layout.describe()} on the Ray cluster ({device}); rendezvous on node 0 "
                f"at {self.master['addr']}")

    # ------------------------------------------------------------------ start, poll, stop
    def _start(self) -> None:
        self._t0 = time.monotonic()
        ray = connect(self.cluster)
        self.conn = Connection(ray)
        self._mark("connected")
        self.layout = placement.plan(placement.cluster_nodes(ray), gpus=self.spec.nproc_per_node,
                                     gpu_type=self.spec.gpu_type,
                                     gpus_per_node=self.cluster.gpus_per_node,
                                     autoscaling=self.cluster.autoscaling)
        self.spec = dataclasses.replace(self.spec, nproc_per_node=self.layout.nproc_per_node,
                                        nnodes=self.layout.nnodes, device=self.layout.device)
        self._write_record()
        timeout = self.cluster.placement_timeout if not self.cluster.autoscaling \
            else max(self.cluster.placement_timeout, 600.0)
        try:
            self.pg, _ = placement.reserve(ray, self.layout, timeout=timeout,
                                           name=f"gpulaunch-{self.run.run_id}")
            self._mark("placed")
            self._start_nodes(ray)
            self._mark("started")
        except BaseException as e:
            self._teardown()
            self.finished = True
            self._write_job(RunState.AGENT_ERROR)
            if isinstance(e, (errors.GpulaunchError, KeyboardInterrupt)):
                raise
            raise errors.LaunchError(
                f"The job's node agents could not be started on the Ray cluster: "
                f"{type(e).__name__}: {e}\nRun directory: {self.run.path}",
                run_dir=str(self.run.path)) from e
        if self.stream:
            per = self.layout.nproc_per_node
            self.streamer = LogStreamer(prefix=lambda r: f"[node {r // per} rank {r}] ",
                                        show=self.spec.shows_rank, write=self.write)
            for r in range(self.spec.world_size):
                self.streamer.watch(r, self.run.rank_file(0, r, "log"))
        self._write_job(RunState.RUNNING)

    def _start_nodes(self, ray) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        extra = {}
        if self.cluster.runtime_env and not has_local_paths(self.cluster.runtime_env):
            # URIs, pip, env_vars: per actor. Local paths were uploaded at ray.init (job level).
            extra["runtime_env"] = self.cluster.runtime_env
        remote_cls = ray.remote(NodeAgent)
        actors = []
        for i in range(self.layout.nnodes):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                        placement_group_bundle_index=i)
            actors.append(remote_cls.options(scheduling_strategy=strategy, max_restarts=0,
                                             max_concurrency=4, name=None,
                                             **self.layout.actor_options(), **extra).remote(
                                                 self.run.run_id, i, self.attempt))
        # the handles first: a failed start below must still kill every actor (teardown)
        self.nodes = [NodeHandle(i, a, {}) for i, a in enumerate(actors)]
        infos = ray.get([a.info.remote() for a in actors], timeout=self.spec.start_timeout)
        for n, info in zip(self.nodes, infos):
            n.info = info
        self._mark("actors_up")
        if self._extensions is None:
            # The node agents get the callbacks' fields themselves: they cannot read our
            # directory. Once per job: a restart keeps the tracking run and its fields.
            hosts = sorted({str(n.info.get('host')) for n in self.nodes})
            if self.callbacks is not None:
                self.callbacks.on_placed(self.spec)
            self._extensions = self.callbacks.node_extensions(hosts) \
                if self.callbacks is not None else {}
            self._payload_ref = ray.put(self.payload)
        record = dataclasses.replace(self.record, spec=self.spec, extensions=self._extensions)
        payload_ref = self._payload_ref
        head = self.nodes[0].info
        # Every node's agent starts at once (each imports torch); node 0 binds its store on
        # its cluster IP with a port chosen there, and the others learn it when it is known.
        n = self.layout.nnodes
        started = [actors[0].start.remote(record, payload_ref, n, None, 0)]
        started += [a.start.remote(record, payload_ref, n, head["ip"], None) for a in actors[1:]]
        port = ray.get(started[0], timeout=self.spec.start_timeout)["master_port"]
        self._mark("node0_store_up")
        ray.get([a.set_master_port.remote(port) for a in actors[1:]] + started[1:],
                timeout=self.spec.start_timeout)
        self.master = {"addr": head["ip"], "port": port}
        self._write_record()

    def _poll(self) -> None:
        """Collect what the nodes have, stream logs; restart or end on a failed attempt."""
        if not self.conn.alive():
            self._finish(None)
            return
        try:
            poll_all(self.conn.ray, self.nodes, self.run, wait=constants.RAY_POLL_WAIT_S,
                     lost_after=self.spec.node_lost_timeout)
        except (Exception, SystemExit):
            # ray.shutdown() in another thread while this poll waits in ray.wait(): Ray ends
            # the call with an error, or with SystemExit from its core worker (seen in CI).
            if not self.conn.ending():
                raise
            self._finish(None)
            return
        if "ranks_spawned" not in self.timings and all(
                n.status.state is RunState.RUNNING or n.status.state.terminal
                for n in self.nodes):
            self._mark("ranks_spawned")
        if self.streamer:
            self.streamer.pump()
        if not self._stacks_asked and any(n.status.hang for n in self.nodes):
            self._dump_every_nodes_stacks()
            self._attempt_failed()
        elif self._lost() or any(n.failed for n in self.nodes):
            self._attempt_failed()
        elif self._errors.own_failure(self.attempt):   # a rank raised: stop every node now
            self._mark("rank_error_seen")
            self._attempt_failed()
        elif all(n.done for n in self.nodes):
            self._finish(None)
        else:
            self._write_job(RunState.RUNNING)

    def _stop(self, reason: StopReason) -> None:
        self._finish(reason)

    def _attempt_failed(self) -> bool:
        """This attempt failed on some node: restart the whole job while restarts are left
        (``restarts``), else end it. True once the run has ended."""
        if self.policy.decide(self.attempt, stopping=self.reason is not None) is Decision.GIVE_UP:
            self._finish(None)
            return True
        self._stop_nodes()               # every node's ranks stopped, their last files here
        cause = restarts.attempt_cause(self.run, self.nodes, self.attempt,
                                       self.spec.world_size, self.spec.nproc_per_node)
        exits = restarts.attempt_exits(self.run, self.nodes, self.attempt)
        self.policy.record(self.attempt, cause, exits)
        self._write_job(RunState.RESTARTING)
        if self.streamer:
            self.streamer.pump(final=True)
            self.streamer.write(restarts.announce(self.attempt, cause, self.spec.max_restarts))
        failed, failed_nodes = self.attempt, self.nodes
        self._kill_actors()
        try:
            if self.run.hang_json.exists():   # the next attempt's hang, if any, is its own
                self.run.hang_json.replace(self.run.attempt_dir(failed) / "hang.json")
            restarts.wait_placement(self.conn.ray, self.pg, self.layout.nnodes,
                                    self.cluster.placement_timeout,
                                    probe_resources=self.layout.probe_resources())
            self.attempt, self._stacks_asked = failed + 1, False
            self._start_nodes(self.conn.ray)
        except (Exception, SystemExit) as e:
            if not self.conn.ending():
                if self.nodes is not failed_nodes:
                    self._kill_actors()
                self.policy.record(failed + 1, f"could not start on the cluster: {e}")
            # the job ends with the last attempt that ran, and its error
            self.attempt, self.nodes = failed, failed_nodes
            self._finish(None)
            return True
        if self.streamer:
            for r in range(self.spec.world_size):
                self.streamer.watch(r, self.run.rank_file(self.attempt, r, "log"))
        self._write_job(RunState.RUNNING)
        return False

    def _lost(self) -> NodeHandle | None:
        return next((n for n in self.nodes if n.lost_why is not None), None)

    def _dump_every_nodes_stacks(self) -> None:
        """A node's watchdog declared a hang: before anything is stopped, every other node's
        ranks write their stacks (the node that saw it already did, and waits for us)."""
        self._stacks_asked = True
        refs = [calls.call(n.actor.dump_stacks) for n in self.nodes
                if not n.done and not n.status.hang]
        if refs:
            calls.wait(self.conn.ray, refs, num_returns=len(refs),
                       timeout=constants.RAY_STACKS_TIMEOUT_S)

    def dump_stacks(self) -> None:
        """Stacks on demand (``handle.stacks()``): every live node's ranks write their Python
        stacks now; the files reach this run directory with the next polls."""
        refs = [calls.call(n.actor.dump_stacks) for n in self.nodes if not n.done]
        if refs:
            calls.wait(self.conn.ray, refs, num_returns=len(refs),
                       timeout=constants.RAY_STACKS_TIMEOUT_S)

    # ------------------------------------------------------------------ ending
    def _finish(self, reason: StopReason | None) -> None:
        self.reason = self.reason or reason
        self._mark("ended")
        if self._lost() is not None and self.conn.alive():
            # A node that stopped answering just as ray.shutdown() ran was not lost: the
            # connection ended. Let the shutdown finish so that the error says so.
            self.conn.ending(within=2.0)
        if self.conn.alive():
            try:
                self._stop_nodes()
                self._teardown()
            except (Exception, SystemExit):
                if not self.conn.ending():
                    raise
        self._mark("torn_down")
        if self.streamer:
            self.streamer.pump(final=True)
        try:
            self._write_job(self._final_state())
        finally:
            self.ended()

    def _stop_nodes(self) -> None:
        """Stop every node still running, then collect its last files (logs, errors)."""
        stop_all(self.conn.ray, self.nodes,
                 grace=self.spec.shutdown_grace + constants.RAY_STOP_EXTRA_S)
        self._mark("nodes_stopped")
        drain_all(self.conn.ray, self.nodes, self.run)
        self._mark("drained")

    def _kill_actors(self) -> None:
        for n in self.nodes:
            try:
                calls.kill(self.conn.ray, n.actor)
            except (Exception, SystemExit):
                pass

    def _teardown(self) -> None:
        if self.conn is None or not self.conn.alive():
            return
        self._kill_actors()
        if self.pg is not None:
            try:
                from ray.util.placement_group import remove_placement_group
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001
                pass
            self.pg = None

    # ------------------------------------------------------------------ records
    def _write_record(self) -> None:
        cluster = {"address": self.cluster.resolved_address(),
                   "layout": dataclasses.asdict(self.layout) if self.layout else None,
                   "nodes": [n.info for n in self.nodes], "master": self.master}
        self.record = dataclasses.replace(self.record, spec=self.spec, backend="ray",
                                          cluster=cluster, caller_pid=os.getpid(),
                                          host=hostname(), started=time.time())
        self.run.write_launch(self.record)

    def _write_job(self, state: RunState) -> None:
        lost = self._lost()
        job = JobStatus(state=state, nodes=[n.status for n in self.nodes], timings=self.timings,
                        lost_node=lost.node_rank if lost else None,
                        lost_why=lost.lost_why if lost else None, attempt=self.attempt,
                        history=self.policy.history)
        write_json_atomic(self.run.job_json, job.to_data())

    def _final_state(self) -> RunState:
        states = [n.status.state for n in self.nodes]
        if self.conn is not None and self.conn.ended:
            return RunState.DISCONNECTED
        if self._lost() is not None:
            return RunState.NODE_LOST
        if states and all(s is RunState.SUCCEEDED for s in states):
            return RunState.SUCCEEDED
        if any(s is RunState.FAILED for s in states) or self._errors.raised(self.attempt):
            return RunState.FAILED
        if any(s is RunState.AGENT_ERROR for s in states):
            return RunState.AGENT_ERROR
        return RunState.STOPPED

    # ------------------------------------------------------------------ results

    def outcome(self):
        exits = restarts.attempt_exits(self.run, self.nodes, self.attempt)
        broken = next((n for n in self.nodes if n.status.state is RunState.AGENT_ERROR), None)
        lost = self._lost()
        lost_node = None
        if lost is not None and self.reason is None:
            per = self.spec.nproc_per_node
            lost_node = LostNode(lost.node_rank, lost.lost_why, lost.describe(per),
                                 host=lost.info.get("host"), first_rank=lost.node_rank * per)
        state = self._final_state()
        if state is RunState.NODE_LOST and lost_node is None:
            state = RunState.STOPPED
        return collect.collect(
            self.run, state=state, world_size=self.spec.world_size, attempt=self.attempt,
            exits=exits, history=self.policy.history,
            reason=self.reason, timeout=self.spec.timeout,
            agent_error=broken.status.error if broken else None,
            agent_traceback=broken.status.traceback if broken else "", lost=lost_node,
            nproc_per_node=self.spec.nproc_per_node)

