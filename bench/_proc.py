"""Run a benchmark child so that a timeout can never leave its children behind (a torchrun's
ranks, a DeepSpeed JIT build's ninja and compilers): its own session, killed as a group."""

from __future__ import annotations

import os
import signal
import subprocess


def run_group(cmd, *, timeout: float, **kw) -> subprocess.CompletedProcess:
    """Like ``subprocess.run(cmd, capture_output=True, text=True, timeout=...)``, but on a
    timeout the child's whole process group is SIGKILLed before TimeoutExpired is raised."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as e:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from e
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # whatever the child left in its group after it exited (it should be nothing)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def exit_on_sigterm() -> None:
    """A driver stopped by SIGTERM (``timeout``, a CI runner) unwinds like Ctrl-C, so that
    ``run_group``'s cleanup kills the running child's group instead of orphaning it."""
    import sys

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
