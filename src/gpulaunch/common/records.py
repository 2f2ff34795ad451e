"""The typed records that cross process boundaries, and the states a run goes through.

    caller ──launch.json (LaunchRecord)──▶ node agent ──env + payload──▶ ranks
    caller ◀──status.json (NodeStatus)──── node agent
    caller ◀──rank<r>.info.json (RankInfo), .error.pkl (RankError), .stuck (StuckReport)── ranks
    caller ◀──hang.json (HangRecord)────── node agent

Each is a frozen-or-plain dataclass with ``to_json``/``from_json`` (``serde.Record``); the files
themselves are named by ``rundir.RunDir``. ``LaunchRecord.version`` is checked by the agent: a
caller and an agent of different gpulaunch versions refuse each other with a clear message
instead of misreading fields.
"""

from __future__ import annotations

import dataclasses
import enum

from ..hardware.catalog import GPUType
from .serde import Record

RECORD_VERSION = 2


class RunState(str, enum.Enum):
    """A run as its caller follows it (``handle.status``, ``on_end``, tracking.json): the run
    controller's state machine (``caller/controller.py``). A ``str`` enum: compares equal to
    its name, so ``handle.status == "SUCCEEDED"`` keeps working."""

    PENDING = "PENDING"            # created, nothing started yet
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"              # a rank or the backend failed (restart budget spent)
    CANCELLED = "CANCELLED"        # cancel(), Ctrl-C
    TIMED_OUT = "TIMED_OUT"        # timeout=

    @property
    def terminal(self) -> bool:
        return self not in (RunState.PENDING, RunState.RUNNING)

    def __str__(self) -> str:
        return self.value


class NodeState(str, enum.Enum):
    """One node's share of a run as its node agent (or the warm pool) reports it in
    status.json, the Ray job's account of its nodes in job.json, and how a backend ended
    (``RunOutcome.state``), which the controller turns into a ``RunState``. The same strings as
    the ``RunState`` values of older releases: their files read as before."""

    PENDING = "PENDING"            # job.json: the Ray job is placed, no node has reported
    STARTING = "STARTING"          # node agent: up, ranks not started yet
    RUNNING = "RUNNING"
    RESTARTING = "RESTARTING"      # an attempt failed, the next one starts
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"              # a rank failed (restart budget spent)
    STOPPED = "STOPPED"            # stopped by a signal (the caller's cancel/timeout)
    AGENT_ERROR = "AGENT_ERROR"    # the node agent failed itself
    NODE_LOST = "NODE_LOST"        # Ray: a node stopped answering
    DISCONNECTED = "DISCONNECTED"  # Ray: the caller's cluster connection ended
    DIED = "DIED"                  # CLI's reading: the agent vanished without an end state

    @property
    def terminal(self) -> bool:
        return self not in (NodeState.PENDING, NodeState.STARTING, NodeState.RUNNING,
                            NodeState.RESTARTING)

    def __str__(self) -> str:
        return self.value


def state_is_terminal(value: str) -> bool:
    """Has a run ended, by a state read from its files: a caller's verdict (``RunState``) or a
    node's or job's account (``NodeState``). An unknown value counts as not ended."""
    for kind in (RunState, NodeState):
        try:
            return kind(value).terminal
        except ValueError:
            continue
    return False


class StopReason(str, enum.Enum):
    """Why the caller stopped a run (None: it ended by itself)."""

    TIMEOUT = "timeout"
    CANCELLED = "cancelled"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class LaunchSpec(Record):
    """The resolved, validated description of one launch (``caller.spec.resolve``)."""

    nproc_per_node: int
    device: str                                 # "cuda" or "cpu"
    gpu_type: GPUType | None = None
    nnodes: int = 1
    timeout: float | None = None
    hang_timeout: float | None = None
    max_restarts: int = 0
    shutdown_grace: float = 5.0
    stream_logs: str | tuple[int, ...] = "all"
    remote: bool = False
    env: tuple[tuple[str, str], ...] = ()       # env= plus settings that travel as variables
    start_timeout: float = 180.0
    node_lost_timeout: float = 30.0
    keep_alive: float | bool = False            # a warm pool's idle seconds (False: cold)
    debug: bool = False                         # pdb at a failing rank's frame

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def process_group_backend(self) -> str:
        """torch.distributed's backend ("nccl" or "gloo"); ``LaunchRecord.backend`` is where
        the run ran ("local", "ray", ...)."""
        return "nccl" if self.device == "cuda" else "gloo"

    def shows_rank(self, rank: int) -> bool:
        if self.stream_logs == "all":
            return True
        if self.stream_logs == "none":
            return False
        if self.stream_logs == "rank0":
            return rank == 0
        return rank in self.stream_logs


@dataclasses.dataclass(frozen=True)
class Entry(Record):
    """What each rank runs: the shipped function, a script, a module, or any command."""

    kind: str = "function"                      # function | script | module | exec
    argv: tuple[str, ...] = ()

    KINDS = ("function", "script", "module", "exec")

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise ValueError(f"entry kind {self.kind!r} is not one of {self.KINDS}")


@dataclasses.dataclass(frozen=True)
class NodePlacement(Record):
    """Where one node's agent sits in the job. The default is a single host, all on loopback.
    A multi-node backend gives node 0 the address its rendezvous store binds (port 0: chosen
    there) and the other nodes where to find it (now, or later in ``master_port_file``)."""

    node_rank: int = 0
    nnodes: int = 1
    bind_host: str = "127.0.0.1"
    master_addr: str | None = None
    master_port: int = 0
    master_port_file: str | None = None
    # ``gpulaunch run --nnodes``: the agents' store prefix, the same on every node (each node's
    # run directory has its own run id), and every agent stops when another node's ranks fail
    # (``backends.local.peers``). The Ray caller does that stopping itself.
    rdzv_id: str | None = None
    stop_on_peer_failure: bool = False
    # Ray restarts (the caller re-forms the whole job): this node's agent runs attempt
    # ``first_attempt`` of the job, with TORCHELASTIC_RESTART_COUNT and attempt<k>/ folders
    # numbered as the job's attempt, and never restarts its ranks on its own.
    first_attempt: int = 0
    # ``gpulaunch run --nnodes MIN:MAX`` (MIN < MAX; 0: a fixed count): torch's dynamic
    # rendezvous at master_addr:master_port admits min_nodes to ``nnodes`` nodes, numbers them
    # each round (``node_rank`` stays 0: only this node's file names), and restarts the ranks
    # with the new world size when a node is lost or joins. torchrun's --rdzv-conf timings.
    min_nodes: int = 0
    last_call_timeout: float = 30.0
    keep_alive_interval: float = 5.0
    keep_alive_max_attempt: int = 3

    @property
    def elastic(self) -> bool:
        return 0 < self.min_nodes < self.nnodes


@dataclasses.dataclass(frozen=True)
class LaunchRecord(Record):
    """launch.json: what was asked. Written by the caller (or a Ray node actor), read by the
    node agent, ``gpulaunch runs`` and the tracking callback."""

    run_id: str
    label: str
    spec: LaunchSpec
    entry: Entry = Entry()
    placement: NodePlacement = NodePlacement()
    backend: str = "local"
    caller_pid: int = 0
    host: str = ""
    cwd: str = ""
    argv: tuple[str, ...] = ()
    started: float = 0.0
    # Side concerns' fields for the node agents, by name; each names the module whose
    # ``node_hook(record, run, fields)`` the agent calls (``backends.local.agent``).
    extensions: dict[str, dict] = dataclasses.field(default_factory=dict)
    cluster: dict | None = None                 # Ray: address, layout, nodes, master
    version: int = RECORD_VERSION

    @property
    def world_size(self) -> int:
        return self.spec.world_size


@dataclasses.dataclass(frozen=True)
class RankExit(Record):
    """How one rank process ended (torchelastic's ProcessFailure, as data)."""

    rank: int
    exitcode: int | None
    local_rank: int = 0
    pid: int = 0
    timestamp: float = 0.0
    message: str = ""


@dataclasses.dataclass(frozen=True)
class AttemptRecord(Record):
    """One failed attempt of a run with restarts."""

    attempt: int
    ended: float
    failures: dict[int, RankExit] = dataclasses.field(default_factory=dict)
    cause: str = ""               # the attempt's root cause in words, when the caller knew it
    preempted: bool = False       # stopped for a preemption notice (max_preemptions), not failed
    # --nnodes MIN:MAX: the attempt's world size and node count; ``membership``: its ranks were
    # healthy and restarted for a node waiting to join (not a failure, max_restarts not spent)
    world_size: int = 0
    nnodes: int = 0
    membership: bool = False


@dataclasses.dataclass(frozen=True)
class PeerFailure(Record):
    """What one node of a ``gpulaunch run --nnodes`` job tells the others when its ranks
    failed: its root cause, in words, and where its logs are."""

    node_rank: int
    rank: int
    exit_code: int | None
    summary: str                  # "rank 3: ValueError: boom" / "rank 3 was killed by SIGKILL"
    host: str = ""
    run_dir: str = ""


@dataclasses.dataclass
class NodeStatus(Record):
    """status.json (node 0) / status.node<n>.json: one node agent's account of its ranks."""

    state: NodeState = NodeState.STARTING
    node_rank: int = 0
    attempt: int = 0
    agent_pid: int | None = None
    pids: dict[int, int] = dataclasses.field(default_factory=dict)   # global rank -> pid
    started: float = 0.0
    ended: float | None = None
    history: list[AttemptRecord] = dataclasses.field(default_factory=list)
    failures: dict[int, RankExit] = dataclasses.field(default_factory=dict)
    master_port: int | None = None
    start_method: str | None = None
    start_method_reason: str | None = None
    forked_at: float | None = None
    warm_start: bool = False
    hang: bool = False
    error: str | None = None
    traceback: str = ""
    signal: str | None = None
    extensions: dict[str, str] = dataclasses.field(default_factory=dict)
    peer_failure: PeerFailure | None = None    # another node failed; this node's ranks stopped
    # the current attempt's world size, node count and this node's rank in it (--nnodes
    # MIN:MAX: from the rendezvous, changing as nodes come and go)
    world_size: int = 0
    nnodes: int = 0
    group_rank: int | None = None


@dataclasses.dataclass
class JobStatus(Record):
    """job.json in the caller's run directory of a multi-node (Ray) run: the job as the caller
    follows it — its state, each node's ``NodeStatus`` as last reported, phase timings."""

    state: NodeState = NodeState.PENDING
    nodes: list[NodeStatus] = dataclasses.field(default_factory=list)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    lost_node: int | None = None
    lost_why: str | None = None
    attempt: int = 0                                   # the job's attempt (max_restarts)
    history: list[AttemptRecord] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class RankInfo(Record):
    """rank<r>.info.json: written by each rank as it starts."""

    rank: int
    pid: int
    host: str
    local_rank: int = 0
    attempt: int = 0
    started: float = 0.0
    node_rank: int = 0


@dataclasses.dataclass(frozen=True)
class StuckReport(Record):
    """rank<r>.stuck: the rank's stall watchdog saw no progress for ``stuck_for`` seconds."""

    rank: int
    stuck_for: float
    since_unix: float
    where: str


@dataclasses.dataclass(frozen=True)
class HangRecord(Record):
    """hang.json: a node agent acted on a rank's stuck report (stacks dumped, ranks stopped)."""

    detected_by: int
    attempt: int
    stuck_for: float
    where: str
    time: float
    node_rank: int = 0


@dataclasses.dataclass(frozen=True)
class RankError(Record):
    """rank<r>.error.pkl: the exception a rank raised, as data (pickled by the rank).

    ``exception`` is the cloudpickled exception object when it survives a round trip (so the
    caller can re-raise it as itself), else None and the caller raises ``RemoteError``."""

    type: str
    message: str
    traceback: str
    rank: int
    host: str
    exception: bytes | None = None
    collateral: bool = False      # a consequence of a peer's failure (connection closed, ...)
    time: float = float("inf")    # when it was caught (root cause: the earliest own failure)
    exit_code: int | None = None  # SystemExit's code
