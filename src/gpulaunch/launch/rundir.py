"""The run directory: one private folder per call, the only channel between the caller, the
agent and the ranks.

    <home>/runs/<run_id>/            mode 0700
        launch.json                  what was asked (spec, entrypoint, caller, start time)
        payload.pkl                  cloudpickled function + arguments (deleted after the call)
        status.json                  written by the agent: state, attempt, failures, end time
        agent.log                    the agent's own output
        hang.json                    written when the hang watchdog fired
        attempt<k>/rank<r>.log       rank r's stdout+stderr for restart attempt k
        attempt<k>/rank<r>.info.json pid, host, start time (written by the rank at start)
        attempt<k>/rank<r>.result.pkl / .error.pkl / .error.json / .stacks / .stuck

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


def home() -> Path:
    return Path(os.environ.get("GPULAUNCH_HOME") or Path.home() / ".gpulaunch")


def runs_root() -> Path:
    return home() / "runs"


def new_run_id(label: str) -> str:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in label)[:40] or "run"
    return f"{stamp}-{safe}-{secrets.token_hex(3)}"


def create(label: str) -> "RunDir":
    root = runs_root()
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    run_id = new_run_id(label)
    path = root / run_id
    path.mkdir(mode=0o700)
    os.chmod(path, 0o700)  # mkdir's mode is masked by the umask; make it owner-only for sure
    return RunDir(path)


def write_json_atomic(path: Path, data) -> None:
    # unique per process *and* thread: two threads of one process (a run's follower and a
    # cancel() from the caller, a threaded Ray actor) must never share a temporary file
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "w") as f:
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

    launch_json = property(lambda self: self.path / "launch.json")
    payload = property(lambda self: self.path / "payload.pkl")
    status_json = property(lambda self: self.path / "status.json")
    agent_log = property(lambda self: self.path / "agent.log")
    hang_json = property(lambda self: self.path / "hang.json")
    cancel_flag = property(lambda self: self.path / "cancel")

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

    def status(self) -> dict:
        return read_json(self.status_json, {}) or {}

    def launch(self) -> dict:
        return read_json(self.launch_json, {}) or {}


def hostname() -> str:
    return socket.gethostname()
