"""The processes of one warm pool, as the caller holds them (``pool.py`` runs calls on them).

    RankPool(key).start()     world_size x ``python -u -m gpulaunch.rank.pool_worker``, each in
                              its own session, stdin a pipe from us (requests; EOF = we died),
                              one more pipe back (``ready`` / ``done <seq>``)
    .send(request)            one JSON line to every rank
    .replies(timeout)         the ranks that answered "done" since the last look
    .close(why)               SIGTERM, then SIGKILL, every rank's process group

``pool.json`` in ``<home>/pools/<id>/`` describes a live pool for ``gpulaunch pool`` (another
process: it can list and close pools, never run on them). The ranks' output before their first
call (imports) goes to ``rank<r>.log`` there; each call's output goes to that call's run dir.

``PoolKey`` is what must match for a call to run on a pool: anything that would make a warm
rank behave differently from a cold one (world size, device, GPU type, env=, variables read at
interpreter start, cwd, visible GPUs, the interpreter, and a fingerprint of the installed
distributions and of the user's own imported modules, so that a pool never runs old code).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
import selectors
import socket
import subprocess
import sys
import time

from ...common import constants, private, procutil
from ...common.rundir import home, read_json, write_json_atomic
from .rank_env import rank_env, torchrun_env


def pools_root():
    return home() / "pools"


def installed_fingerprint() -> str:
    """A hash of what is installed on ``sys.path``: every ``*.dist-info`` / ``*.egg-info`` /
    ``*.pth`` with its mtime, so an install or an upgrade changes it (a millisecond or so)."""
    h = hashlib.sha256()
    for entry in sys.path:
        if not entry or not os.path.isdir(entry):
            continue
        try:
            names = sorted(os.listdir(entry))
        except OSError:
            continue
        for name in names:
            if name.endswith((".dist-info", ".egg-info", ".pth", ".egg-link")):
                try:
                    h.update(f"{entry}/{name}:{os.stat(os.path.join(entry, name)).st_mtime_ns}"
                             .encode())
                except OSError:
                    pass
    return h.hexdigest()[:16]


def user_module_files() -> dict[str, int]:
    """The caller's imported modules that are not installed (outside the interpreter's and
    site-packages' folders: the user's own code, a dev checkout) with their mtimes. A pool
    whose ranks may have imported one of them goes cold when one changes."""
    installed = tuple({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)} |
                      {os.path.realpath(p) for p in sys.path if "-packages" in p})
    out = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path or os.path.realpath(path).startswith(installed):
            continue
        try:
            out[path] = os.stat(path).st_mtime_ns
        except OSError:
            pass
    return out


def changed_file(files: dict[str, int]) -> str | None:
    """The first of ``files`` whose mtime changed (or that vanished), else None."""
    for path, mtime in files.items():
        try:
            if os.stat(path).st_mtime_ns != mtime:
                return path
        except OSError:
            return path
    return None


@dataclasses.dataclass(frozen=True)
class PoolKey:
    world_size: int
    device: str
    gpu_type: str | None
    env: tuple[tuple[str, str], ...]
    startup_env: tuple[tuple[str, str], ...]
    cwd: str
    visible_devices: str | None
    executable: str
    installed: str

    @classmethod
    def of(cls, spec, env: dict[str, str]) -> "PoolKey":
        return cls(
            world_size=spec.world_size, device=spec.device,
            gpu_type=spec.gpu_type.name if spec.gpu_type else None,
            env=tuple(spec.env),   # env= only: per-call settings (hang_timeout, debug) are not in it
            startup_env=tuple(sorted((k, v) for k, v in env.items()
                                     if k.startswith(constants.STARTUP_ENV_PREFIXES))),
            cwd=os.getcwd(), visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
            executable=sys.executable, installed=installed_fingerprint())

    def differs(self, other: "PoolKey") -> str:
        """The settings that differ, in words ("" when none)."""
        names = {"installed": "installed packages",
                 "startup_env": "variables read at interpreter start", "env": "env="}
        return ", ".join(names.get(f.name, f.name) for f in dataclasses.fields(self)
                         if getattr(self, f.name) != getattr(other, f.name))

    def digest(self) -> str:
        return hashlib.sha256(repr(self).encode()).hexdigest()[:12]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pool_rank_env(base: dict[str, str], spec, rank: int, port: int, reply_fd: int,
                  run_dir=None) -> dict[str, str]:
    """A pool rank's environment: the one every rank gets (``rank_env``, shared with the node
    agent's cold ranks) plus torchrun's variables and the pool's reply pipe."""
    env = dict(base)
    env.update(torchrun_env(rank, spec.world_size, port))
    env.update({"GPULAUNCH_POOL_REPLY_FD": str(reply_fd),
                "GPULAUNCH_POOL_CALLER_PID": str(os.getpid())})
    rank_env(env, spec, run_dir=run_dir)
    env.update(dict(spec.env))
    return env


class RankPool:
    """The ranks of one pool (caller side)."""

    def __init__(self, key: PoolKey, spec, env: dict[str, str]):
        self.key, self.spec, self.base_env = key, spec, env
        self.pool_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
        self.dir = pools_root() / self.pool_id
        self.procs: list[subprocess.Popen] = []
        self._replies: list[int] = []
        self._partial: dict[int, bytes] = {}
        self.ready: set[int] = set()
        self.started = time.time()
        self.last_used = self.started
        self.calls = 0
        self.user_files = user_module_files()
        self.busy = False
        self.closed: str | None = None
        self.state_owners: dict[str, str] = {}    # rt.state key -> the call that set it

    def start(self) -> "RankPool":
        private.mkdir(self.dir)          # pools/ and pools/<id>/: owner-only
        port = _free_port()
        try:
            for r in range(self.spec.world_size):
                read_end, write_end = os.pipe()
                with private.open_file(self.dir / f"rank{r}.log", "wb") as log:
                    proc = subprocess.Popen(
                        [sys.executable, "-u", "-m", "gpulaunch.rank.pool_worker"],
                        stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                        env=pool_rank_env(self.base_env, self.spec, r, port, write_end),
                        pass_fds=(write_end,), start_new_session=True)
                os.close(write_end)
                os.set_blocking(read_end, False)
                self.procs.append(proc)
                self._replies.append(read_end)
        except BaseException:
            self.close("it failed to start")
            raise
        self.write_record()
        return self

    @property
    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in enumerate(self.procs)}

    def write_record(self) -> None:
        write_json_atomic(self.dir / "pool.json", {
            "pool_id": self.pool_id, "caller_pid": os.getpid(), "pids": self.pids,
            "world_size": self.spec.world_size, "device": self.spec.device,
            "gpu_type": self.key.gpu_type, "key": self.key.digest(), "cwd": self.key.cwd,
            "started": self.started, "last_used": self.last_used, "calls": self.calls})

    def send(self, request: dict) -> None:
        line = (json.dumps(request) + "\n").encode()
        for proc in self.procs:
            view = memoryview(line)
            while view:
                view = view[os.write(proc.stdin.fileno(), view):]

    def exited(self) -> dict[int, int]:
        """Ranks whose process has ended or is ending: rank -> exit code.

        A rank whose main thread already shows as a zombie counts as ended, and we wait (a few
        seconds at most) for its exit code: Linux shows the thread-group leader as a zombie
        while its other threads (torch's, gloo's) are still being torn down, and ``waitpid``
        answers only once the last one is gone. Without the wait, a pool just closed by
        ``gpulaunch pool close`` looks alive for a moment and the next call would run on it."""
        out = {}
        for r, p in enumerate(self.procs):
            if p.poll() is None and not procutil.pid_alive(p.pid):
                try:
                    p.wait(constants.POOL_EXIT_WAIT_S)
                except subprocess.TimeoutExpired:
                    pass
            if p.returncode is not None:
                out[r] = p.returncode
        return out

    def record_removed(self) -> bool:
        """``gpulaunch pool close`` (another process) ended our ranks and removed our record."""
        return not (self.dir / "pool.json").exists()

    def replies_wait(self, timeout: float) -> None:
        """Sleep up to ``timeout`` s, waking as soon as a rank writes (or exits: EOF)."""
        if not self._replies:
            time.sleep(min(timeout, 0.01))
            return
        with selectors.DefaultSelector() as sel:
            for fd in self._replies:
                sel.register(fd, selectors.EVENT_READ)
            sel.select(timeout)

    def replies(self) -> set[int]:
        """Ranks that said "done" since the last look."""
        done = set()
        for r, fd in enumerate(self._replies):
            try:
                chunk = os.read(fd, 4096)
            except (BlockingIOError, OSError):
                chunk = b""
            data = self._partial.get(r, b"") + chunk
            *lines, self._partial[r] = data.split(b"\n")
            for line in lines:
                if line == b"ready":
                    self.ready.add(r)
                elif line.startswith(b"done"):
                    done.add(r)
                    _, _, owners = line.decode(errors="replace").partition(" ")
                    owners = owners.partition(" ")[2]
                    if owners:
                        self.state_owners.update(json.loads(owners))
        return done

    def close(self, why: str, grace: float = 0.0) -> None:
        """End every rank (SIGTERM, ``grace`` s, SIGKILL), once; ``why`` is remembered."""
        if self.closed is not None:
            return
        self.closed = why
        pids = [p.pid for p in self.procs if p.poll() is None]
        if pids:
            procutil.terminate_then_kill(pids, grace)
        for proc in self.procs:
            try:
                proc.stdin.close()
            except OSError:
                pass
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        for fd in self._replies:
            try:
                os.close(fd)
            except OSError:
                pass
        self._replies = []
        remove_dir(self.dir)


def remove_dir(path) -> None:
    import shutil
    shutil.rmtree(path, ignore_errors=True)


def live_pools() -> list[dict]:
    """Every pool on this host whose ranks still run (``pool.json`` records), oldest first."""
    out = []
    root = pools_root()
    for path in sorted(root.glob("*/pool.json")) if root.is_dir() else []:
        rec = read_json(path)
        if not rec:
            continue
        alive = [int(p) for p in rec.get("pids", {}).values() if procutil.pid_alive(int(p))]
        if alive:
            out.append(dict(rec, alive=alive, dir=str(path.parent)))
        else:
            remove_dir(path.parent)             # a pool that ended without tidying up
    return out


def close_recorded(rec: dict, grace: float = 2.0) -> None:
    """Close a pool from another process (``gpulaunch pool close``): its owner starts cold."""
    procutil.terminate_then_kill(rec.get("alive") or [], grace)
    remove_dir(rec["dir"])

