"""Small process-hygiene helpers: parent-death signals and killing process trees."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1


# Held by the agent while it forks ranks, and by its helper threads (the system-metrics
# sampler) around network calls: a rank forked while another thread of the agent sits inside a
# name lookup inherits glibc's resolver lock held, and hangs in its own first lookup.
FORK_QUIET = threading.Lock()


def _fresh_fork_quiet() -> None:
    # a forked rank inherits the lock held by the agent's forking thread: give it a free one
    global FORK_QUIET
    FORK_QUIET = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_fork_quiet)


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux only).

    Returns False where unsupported. If the parent is already gone (we were re-parented to
    init or a subreaper between fork and this call), exit at once: nobody is waiting for us.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except OSError:
        return False
    return True


def parent_alive(expected_ppid: int) -> bool:
    return os.getppid() == expected_ppid


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); treat it as dead.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def kill_pids(pids, sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_process_groups(pids, sig: int) -> None:
    """Signal each pid's whole process group (ranks run in their own session/group, so this
    also reaches their DataLoader workers and other children)."""
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            kill_pids([pid], sig)


def terminate_then_kill(pids, grace: float, *, groups: bool = True) -> None:
    """SIGTERM, wait up to ``grace`` seconds, then SIGKILL whatever is left."""
    pids = [p for p in pids if p and p > 0]
    send = kill_process_groups if groups else kill_pids
    send(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.05)
    send([p for p in pids if pid_alive(p)] if not groups else pids, signal.SIGKILL)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"
