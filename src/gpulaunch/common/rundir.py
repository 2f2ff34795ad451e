"""The run directory: one private folder per call, the only channel between the caller, the
agent and the ranks.

    <home>/runs/<run_id>/            mode 0700
        launch.json                  LaunchRecord: what was asked (spec, entry, caller, start)
        payload.pkl                  cloudpickled function + arguments
        status.json                  NodeStatus of node 0 (status.node<n>.json: node n)
        job.json                     JobStatus: a Ray run as its caller follows it
        agent.log                    the agent's own output
        hang.json                    HangRecord: written when the hang watchdog fired
        attempt<k>/rank<r>.log       rank r's stdout+stderr for restart attempt k
        attempt<k>/rank<r>.info.json RankInfo: pid, host, start time (written by the rank)
        attempt<k>/rank<r>.result.pkl / .error.pkl (RankError) / .stuck (StuckReport) / .stacks
        attempt<k>/rank<r>.nccl_trace.pkl   NCCL flight recorder, dumped on a hang (GPU ranks)
        attempt<k>/rank<r>.loaded    empty: rank r has read payload.pkl (the agent then drops it)

The record types are in ``records.py``; this module only names the files and reads/writes them.

``<home>`` is ``$GPULAUNCH_HOME`` or ``~/.gpulaunch``.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import secrets
import socket
import threading
from pathlib import Path

from . import redact
from .records import HangRecord, JobStatus, LaunchRecord, NodeStatus, RankInfo


def home() -> Path:
    return Path(os.environ.get("GPULAUNCH_HOME") or Path.home() / ".gpulaunch")


def runs_root() -> Path:
    return home() / "runs"


def new_run_id(label: str) -> str:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in label)[:40] or "run"
    return f"{stamp}-{safe}-{secrets.token_hex(3)}"


def ensure_home() -> Path:
    """The home folder, created owner-only (0700), and checked as ssh checks ~/.ssh: a folder
    another user owns, or one that others may write to, could have its run directories (the
    pickled calls, results, logs) read or replaced; it is refused with the fix. The default
    ~/.gpulaunch of an older version (0755) is tightened to 0700 instead."""
    from ..errors import ConfigurationError
    h = home()
    explicit = bool(os.environ.get("GPULAUNCH_HOME"))
    if not h.exists():
        h.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(h, 0o700)
    st = h.stat()
    if st.st_uid != os.getuid():
        raise ConfigurationError(
            f"gpulaunch's home {h} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}): "
            "its runs (pickled calls, results) would be readable or replaceable by that user. "
            "Point GPULAUNCH_HOME to a folder of your own (e.g. ~/.gpulaunch).")
    if st.st_mode & 0o077:
        if explicit and st.st_mode & 0o022:
            raise ConfigurationError(
                f"GPULAUNCH_HOME={h} is writable by group or others (mode "
                f"{oct(st.st_mode & 0o777)}): another user could replace a run's files. Fix: "
                f"`chmod 700 {h}`, or point GPULAUNCH_HOME to a private folder.")
        if not explicit:
            os.chmod(h, 0o700)
    return h


def create(label: str) -> "RunDir":
    ensure_home()
    root = runs_root()
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(root, 0o700)
    run_id = new_run_id(label)
    path = root / run_id
    path.mkdir(mode=0o700)
    os.chmod(path, 0o700)  # mkdir's mode is masked by the umask; make it owner-only for sure
    return RunDir(path)


def write_json_atomic(path: Path, data) -> None:
    # unique per process *and* thread: two threads of one process (a run's follower and a
    # cancel() from the caller, a threaded Ray actor) must never share a temporary file
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def read_json(path: Path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


class RunDir:
    """Paths inside one run directory (no I/O policy beyond naming)."""

    def __init__(self, path: os.PathLike | str):
        self.path = Path(path)

    @property
    def run_id(self) -> str:
        return self.path.name

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    launch_json = property(lambda self: self.path / "launch.json")
    payload = property(lambda self: self.path / "payload.pkl")
    status_json = property(lambda self: self.path / "status.json")
    agent_log = property(lambda self: self.path / "agent.log")
    hang_json = property(lambda self: self.path / "hang.json")
    job_json = property(lambda self: self.path / "job.json")          # Ray runs

    def status_path(self, node_rank: int = 0) -> Path:
        return self.status_json if node_rank == 0 else self.path / f"status.node{node_rank}.json"

    def attempt_dir(self, attempt: int) -> Path:
        return self.path / f"attempt{attempt}"

    def rank_file(self, attempt: int, rank: int, suffix: str) -> Path:
        return self.attempt_dir(attempt) / f"rank{rank}.{suffix}"

    def attempts(self) -> list[int]:
        out = []
        for p in self.path.glob("attempt*"):
            tail = p.name[len("attempt"):]
            if tail.isdigit():
                out.append(int(tail))
        return sorted(out)

    # typed reads (None / a default record when the file is missing or being written)
    def status(self, node_rank: int = 0) -> NodeStatus:
        data = read_json(self.status_path(node_rank))
        return NodeStatus.from_data(data) if data else NodeStatus(node_rank=node_rank)

    def write_status(self, status: NodeStatus) -> None:
        write_json_atomic(self.status_path(status.node_rank), status.to_data())

    def launch(self) -> LaunchRecord | None:
        data = read_json(self.launch_json)
        return LaunchRecord.from_data(data) if data else None

    def write_launch(self, record: LaunchRecord) -> None:
        """Stored redacted: env= values and secret-looking arguments never reach the disk
        (``redact.py``; the agent gets them through its environment)."""
        write_json_atomic(self.launch_json, redact.redacted(record).to_data())

    def rank_info(self, attempt: int, rank: int) -> RankInfo | None:
        data = read_json(self.rank_file(attempt, rank, "info.json"))
        return RankInfo.from_data(data) if data else None

    def job(self) -> JobStatus | None:
        data = read_json(self.job_json)
        return JobStatus.from_data(data) if data else None

    def hang(self) -> HangRecord | None:
        data = read_json(self.hang_json)
        return HangRecord.from_data(data) if data else None

    # the payload: deleted as soon as no rank can need it any more (it may be gigabytes, and
    # hold secrets); see backends/local/agent.py for who decides when
    def mark_loaded(self, attempt: int, rank: int) -> None:
        """Written by a rank once it has read and closed the payload file."""
        self.rank_file(attempt, rank, "loaded").touch(mode=0o600)

    def loaded_count(self, attempt: int) -> int:
        return len(list(self.attempt_dir(attempt).glob("rank*.loaded")))

    def drop_payload(self) -> bool:
        """Delete payload.pkl; True if it was there. Idempotent and race-free: unlink is atomic
        and a second caller just finds nothing."""
        try:
            self.payload.unlink()
            return True
        except FileNotFoundError:
            return False

    def rank_pids(self) -> list[int]:
        """Every rank pid this run recorded (status and each attempt's info files)."""
        pids = set(self.status().pids.values())
        for attempt in self.attempts():
            for info in self.attempt_dir(attempt).glob("rank*.info.json"):
                pid = (read_json(info, {}) or {}).get("pid")
                if pid:
                    pids.add(int(pid))
        return sorted(pids)


def hostname() -> str:
    return socket.gethostname()
