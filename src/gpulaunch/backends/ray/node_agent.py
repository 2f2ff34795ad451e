"""The Ray actor that runs one node's share of a job, with the local backend.

One ``NodeAgent`` is placed in each bundle of the job's placement group. It does not launch
ranks itself: it writes a node-local run directory and starts the very agent a single-host run
uses (``backends/local``: torchelastic's LocalElasticAgent, the worker entry point, error files,
hang watchdog), through ``LocalRun``, told its place in the job (``NodePlacement``). So every
behaviour of a local run (rank environment, restarts of a rank's process tree, SIGTERM then
SIGKILL, errors as data) is the same on every node of a cluster.

The caller follows the node through ``poll()``: the node's status plus whatever is new in its
run directory (log bytes, result and error files), which the caller mirrors into its own run
directory. Nothing is assumed about shared storage between nodes.

Process ownership: the local agent holds a pipe from this actor on its stdin. If this actor
dies (``ray.kill``, a lost node, the caller's death reaping its actors), the pipe closes and the
agent stops its ranks, which themselves die with their agent (parent-death signal).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import time
from pathlib import Path

from ...common import constants, procutil
from ...common.records import LaunchRecord, LaunchSpec, NodePlacement, NodeStatus, StopReason
from ...common.rundir import RunDir, home
from ..local.run import LocalRun

# Files a rank writes, mirrored to the caller as a whole when they change.
WHOLE_SUFFIXES = (".info.json", ".result.pkl", ".error.pkl", ".error.json", ".stacks", ".stuck",
                  ".stderr.log", ".nccl_trace.pkl")
LOG_CHUNK = 4 << 20          # log bytes per file per poll


def interface_for(ip: str) -> str | None:
    """The network interface holding ``ip`` (for GLOO/NCCL_SOCKET_IFNAME)."""
    try:
        import psutil
        for name, addrs in psutil.net_if_addrs().items():
            if any(a.address == ip for a in addrs):
                return name
    except Exception:
        pass
    return None


def node_home() -> Path:
    return home() / "ray-nodes"


class NodeAgent:
    """Ray actor class (wrapped with ``ray.remote`` by the caller)."""

    def __init__(self, run_id: str, node_rank: int, attempt: int = 0):
        import ray
        self.node_rank = node_rank
        self.attempt = attempt             # the job's attempt (the caller restarts the job)
        self.node_ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        # <home>/ray-nodes/<node id>/runs/<run_id>: one folder per Ray node, so simulated
        # nodes sharing a disk never share a run directory (exactly like separate machines).
        root = node_home() / self.node_id[:12] / "runs"
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        # a restarted job gets a fresh folder per attempt (the last one may still be removed)
        path = root / (run_id if not attempt else f"{run_id}.attempt{attempt}")
        path.mkdir(mode=0o700)
        os.chmod(path, 0o700)
        self.run = RunDir(path)
        self.local: LocalRun | None = None
        self._final: dict | None = None    # the last answer, once this node's dir is removed

    def info(self) -> dict:
        import ray
        return {"node_rank": self.node_rank, "ip": self.node_ip, "node_id": self.node_id,
                "host": socket.gethostname(), "actor_pid": os.getpid(),
                "run_dir": str(self.run.path),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def start(self, record: LaunchRecord, payload: bytes, nnodes: int,
              master_addr: str | None, master_port: int | None) -> dict:
        """Start this node's local agent. Node 0 binds the rendezvous store on its own cluster
        IP with a port chosen here and returns it; the others connect to it (given now, or
        later through ``set_master_port``). The record's extensions (the caller's callbacks'
        fields, e.g. the MLflow run's ids) reach this node's agent and ranks."""
        if payload is not None:            # a script / module / command has none
            with open(os.open(self.run.payload, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600),
                      "wb") as f:
                f.write(payload)
        self._set_network_env(record.spec)
        port_file = str(self.run.path / "master_port") if self.node_rank and not master_port \
            else None
        placement = NodePlacement(node_rank=self.node_rank, nnodes=nnodes,
                                  bind_host=self.node_ip, master_addr=master_addr,
                                  master_port=master_port or 0, master_port_file=port_file,
                                  first_attempt=self.attempt)
        # The caller enforces timeout= for the whole job, and stops every node on it; it also
        # restarts the whole job (max_restarts): this node's agent runs attempt k, restarting
        # nothing itself (max_restarts == first_attempt: no restart left).
        node_record = dataclasses.replace(record, placement=placement, spec=dataclasses.replace(
            _without_timeout(record.spec), max_restarts=self.attempt))
        self.local = LocalRun(node_record, self.run, stream=False)
        self.local.start()
        if self.node_rank != 0:
            return {"master_port": master_port}
        deadline = time.monotonic() + constants.MASTER_PORT_WAIT_S
        while time.monotonic() < deadline:
            port = self._status().master_port
            if port:
                return {"master_port": int(port)}
            if self.local.poll():
                break
            time.sleep(0.05)
        self.local.stop(StopReason.CANCELLED)
        tail = self.run.agent_log.read_text(errors="replace")[-3000:] \
            if self.run.agent_log.exists() else ""
        raise RuntimeError(f"node 0's agent did not open its rendezvous store; its output:\n"
                           f"{tail}")

    def set_master_port(self, port: int) -> None:
        """Nodes > 0 started before node 0's port was known: hand it to the waiting agent."""
        tmp = self.run.path / ".master_port.tmp"
        tmp.write_text(str(int(port)))
        os.replace(tmp, self.run.path / "master_port")

    def _set_network_env(self, spec: LaunchSpec) -> None:
        # Collectives must use the interface Ray reaches this node on: a host name that
        # resolves to 127.0.1.1 (common on Debian/Ubuntu) would break gloo across machines.
        user = dict(spec.env)
        ifname = interface_for(self.node_ip)
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if ifname and var not in user and var not in os.environ:
                os.environ[var] = ifname
        # Ray sets OMP_NUM_THREADS to the actor's CPU count; ranks get torchrun's default.
        if "OMP_NUM_THREADS" not in user:
            os.environ["OMP_NUM_THREADS"] = "1"

    def _status(self):
        if self._final is not None:
            return NodeStatus.from_data(self._final["status"])
        return self.run.status(self.node_rank)

    def poll(self, cursors: dict) -> dict:
        """The node's state and what changed in its run directory since ``cursors``.

        Once this node's agent has ended and the caller holds every file (it asked with
        cursors that leave nothing to send), the node's run directory is removed: the caller's
        mirror is the run's record, and a node must not keep a copy of each run (payload,
        logs, results) for ever. Later polls get the last answer again."""
        if self._final is not None:
            return self._final
        answer = self._poll(cursors)
        if answer["done"] and not answer["files"]:
            self._final = answer
            shutil.rmtree(self.run.path, ignore_errors=True)
        return answer

    def _poll(self, cursors: dict) -> dict:
        done = self.local.poll() if self.local is not None else False
        status = self._status().to_data()
        files = {}
        for attempt in self.run.attempts():
            adir = self.run.attempt_dir(attempt)
            for p in sorted(adir.iterdir()):
                rel = f"{adir.name}/{p.name}"
                try:
                    st = p.stat()
                except FileNotFoundError:
                    continue
                if p.name.endswith(".log") and not p.name.endswith(".stderr.log"):
                    offset = int(cursors.get(rel, 0))
                    if st.st_size > offset:
                        with open(p, "rb") as f:
                            f.seek(offset)
                            files[rel] = ("append", offset, f.read(LOG_CHUNK))
                elif p.name.endswith(WHOLE_SUFFIXES):
                    mark = [st.st_size, st.st_mtime_ns]
                    if cursors.get(rel) != mark:
                        files[rel] = ("whole", mark, p.read_bytes())
        if self.run.hang_json.exists():
            data = self.run.hang_json.read_bytes()
            if cursors.get("hang.json") != len(data):
                files["hang.json"] = ("whole", len(data), data)
        for p in self.run.path.glob("system_metrics.node*.json"):   # tracking's handoff
            data = p.read_bytes()
            if cursors.get(p.name) != len(data):
                files[p.name] = ("whole", len(data), data)
        return {"node_rank": self.node_rank, "done": done, "status": status, "files": files,
                "agent_exit": self.local.proc.poll() if self.local and self.local.proc else None,
                "agent_tail": _tail(self.run.agent_log) if done else ""}

    def dump_stacks(self) -> list[int]:
        """Have each of this node's ranks write every thread's Python stack (faulthandler on
        SIGUSR1, into ``rank<r>.stacks``): another node saw a hang, and the report must show
        where the ranks here were waiting."""
        if self.local is None:
            return []
        pids = [p for p in self.local.rank_pids() if procutil.pid_alive(p)]
        procutil.kill_pids(pids, signal.SIGUSR1)
        time.sleep(constants.STACK_DUMP_WAIT_S)   # faulthandler writes from a signal handler
        return pids

    def stop(self) -> dict:
        """Stop this node's ranks (SIGTERM, then SIGKILL after the grace period)."""
        if self.local is not None:
            self.local.stop(StopReason.CANCELLED)
            return {"left": self.local.kill_leftovers(), "status": self._status().to_data()}
        return {"left": [], "status": self._status().to_data()}

    def pids(self) -> list[int]:
        """Every process of this node's share of the job (agent and ranks), for hygiene checks."""
        out = [os.getpid()]
        if self.local is not None and self.local.proc is not None:
            out.append(self.local.proc.pid)
            out.extend(self.local.rank_pids())
        return out


def _without_timeout(spec: LaunchSpec) -> LaunchSpec:
    return dataclasses.replace(spec, timeout=None)


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""
