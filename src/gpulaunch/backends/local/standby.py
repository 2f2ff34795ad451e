"""A standby agent: the next run's agent process, started ahead with torch already imported.

Almost all of a local launch's cost is the agent's interpreter importing torch (1-2 s on an
idle laptop, 4-5 s on a GPU host; the forked ranks inherit it). Fork launchers that run inside
the caller (Accelerate's ``notebook_launcher``, ``elastic_launch`` with fork) do not pay it,
but they put the agent's signal handlers, store and child processes into the user's notebook
kernel, which gpulaunch will not do. So after a run ends, the caller starts the *next* agent
right away, and it waits, with torch imported, until a run comes:

    caller                                   standby process
    ------                                   ---------------
    run 1 ends -> replenish() ------------>  import torch + the agent; wait on stdin
    run 2: take() writes one JSON line --->  {"run_dir", "env", "cwd"}: apply env and cwd,
                                             send output to run_dir/agent.log, run the agent
    (stdin stays open: EOF = caller died)    (EOF before a request: exit quietly)

A process that launches once pays nothing extra (the standby is started only when a run ends)
and one that launches again starts warm. The standby's environment is the caller's at the
moment of the request, applied before the agent reads anything, except for what an
interpreter or torch reads while starting up (``STARTUP_ENV_PREFIXES``): if one of those
changed since the standby started, it is discarded and the run starts cold, as before; so is
one started before a package was installed or upgraded (``installed_fingerprint``: the site
folders' and PYTHONPATH entries' modification times). Its stderr goes to ``<home>/standby.log``.

It is never used for a node of a multi-node run or by ``gpulaunch run`` (one launch per
process), and ``GPULAUNCH_STANDBY=0`` turns it off. An idle standby costs one process with
torch imported: 518 MiB resident, 284 MiB of it its own (USS), measured with torch 2.14.1 on
the 2-core dev machine; no GPU memory (the agent never touches a GPU) and no CPU while it waits.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading

from ...common import constants

ENV_SWITCH = "GPULAUNCH_STANDBY"
STARTUP_ENV_PREFIXES = constants.STARTUP_ENV_PREFIXES


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def _startup_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items()
            if k.startswith(STARTUP_ENV_PREFIXES) or k in constants.STARTUP_ENV_NAMES}


def installed_fingerprint(env: dict[str, str]) -> tuple:
    """What an interpreter would import from: each site directory and PYTHONPATH entry with its
    modification time. ``%pip install -U torch`` in the notebook adds and removes
    ``*.dist-info`` folders there, which changes the folder's mtime: a standby that imported
    the old torch must not run the next call. One stat per folder: microseconds."""
    import site
    dirs = list(site.getsitepackages()) + [site.getusersitepackages()]
    dirs += [p for p in sys.path if "site-packages" in p or "dist-packages" in p]
    dirs += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    out = []
    for d in dict.fromkeys(dirs):
        try:
            out.append((d, os.stat(d).st_mtime_ns))
        except OSError:
            out.append((d, None))
    return tuple(out)


def stderr_log_path():
    from ...common import rundir
    return rundir.home() / "standby.log"


class StandbyAgent:
    """The caller's side: at most one standby agent per caller process."""

    def __init__(self):
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._startup: dict[str, str] = {}
        self._fingerprint: tuple = ()
        self._ready = False

    def replenish(self, env: dict[str, str]) -> None:
        """Start a standby agent now (after a run ended), unless one is waiting already."""
        if not enabled():
            return
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                return
            try:
                # its stderr (an import failing, a crash while waiting) goes to a log, kept
                # for `doctor` and a failure report, instead of nowhere
                from ...common import rundir
                rundir.ensure_home()
                log = os.open(stderr_log_path(), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    self._proc = subprocess.Popen(
                        [sys.executable, "-m", "gpulaunch.backends.local.standby_process"],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                        start_new_session=True, env=env, close_fds=True,
                        bufsize=0)   # unbuffered: select() on the pipe must see every line
                finally:
                    os.close(log)
            except Exception:  # noqa: BLE001 - OSError, an unsafe home: no standby
                self._proc = None          # no standby: the next run starts cold, as before
                return
            self._fingerprint = installed_fingerprint(env)
            self._startup = _startup_env(env)
            self._ready = False

    def take(self, run_dir: str, env: dict[str, str], cwd: str) -> subprocess.Popen | None:
        """Hand a run to the standby agent; its process, or None (start one cold)."""
        with self._lock:
            proc, self._proc = self._proc, None
            startup, self._startup = self._startup, {}
            fingerprint, self._fingerprint = self._fingerprint, ()
        if proc is None:
            return None
        if proc.poll() is not None or not enabled() or _startup_env(env) != startup or \
                installed_fingerprint(env) != fingerprint:
            _discard(proc)
            return None
        request = (json.dumps({"run_dir": run_dir, "env": env, "cwd": cwd}) + "\n").encode()
        try:
            view = memoryview(request)
            while view:
                view = view[os.write(proc.stdin.fileno(), view):]
        except (BrokenPipeError, OSError, ValueError):
            _discard(proc)
            return None
        # The standby acknowledges from a thread of its own at once (even while importing).
        # No acknowledgement: it died or is stuck; the run starts cold instead.
        if not _read_until(proc, b"ack\n", constants.STANDBY_ACK_TIMEOUT_S):
            _discard(proc)
            return None
        _close_quietly(proc.stdout)
        return proc

    def wait_ready(self, timeout: float) -> bool:
        """True once the waiting standby has imported torch and the agent (it says so with one
        line on its stdout); False if there is none or it is not ready within ``timeout`` s."""
        with self._lock:
            proc, ready = self._proc, self._ready
            if proc is None or proc.poll() is not None:
                return False
            if not ready:
                self._ready = _read_until(proc, b"ready\n", timeout)
            return self._ready

    def close(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None:
            _discard(proc)

    def pid(self) -> int | None:
        """The waiting standby's pid (None when there is none): for tests and ``doctor``."""
        with self._lock:
            proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None


def _read_until(proc: subprocess.Popen, line: bytes, timeout: float) -> bool:
    """Read the standby's stdout lines until ``line`` comes (True) or ``timeout`` s pass."""
    import selectors
    import time
    deadline = time.monotonic() + timeout
    try:
        # selectors (poll/epoll), not select(): select() fails for a descriptor above 1024,
        # which a long-lived notebook with many open files reaches.
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                if not sel.select(left):
                    return False
                got = proc.stdout.readline()
                if not got:                       # EOF: it exited
                    return False
                if got == line:
                    return True
    except (OSError, ValueError):
        return False


def _close_quietly(f) -> None:
    try:
        if f is not None:
            f.close()
    except OSError:
        pass


def _discard(proc: subprocess.Popen) -> None:
    _close_quietly(proc.stdout)
    _close_quietly(proc.stdin)         # EOF: a waiting standby exits by itself...
    try:
        proc.kill()                    # ...but do not wait for it to finish importing torch
        proc.wait(5)
    except (OSError, subprocess.TimeoutExpired):
        pass


STANDBY = StandbyAgent()
atexit.register(STANDBY.close)


