"""Attempts on this host: the attempt process is the supervisor's child, in a session of its
own, writing its log into the job's folder. It gets SIGTERM if the supervisor dies (parent
death signal), and its ranks' agent stops when the attempt's process goes: nothing of a job
outlives its supervisor.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from ...common.procutil import set_parent_death_signal
from .. import environment
from . import result_of, write_ctx

STOP_EXTRA_S = 30.0     # after the launch's own shutdown grace, the attempt is SIGKILLed


class LocalTarget:
    def __init__(self, spec, job):
        self.spec = spec
        self.job = job
        self.python = None

    def prepare(self, cancelled) -> None:
        self.python = environment.python_for(self.spec, log=self.job.log, cancelled=cancelled)

    def argv(self) -> list[str]:
        return [self.python or environment.python_for(self.spec), "-m",
                "gpulaunch.jobs.attempt"]

    def plan(self, ctx: dict) -> str:
        py = self.spec.environment.python or ("<venv built from environment.requirements>"
                                              if self.spec.environment.requirements else
                                              sys.executable)
        return (f"on this host: a detached supervisor runs each attempt as\n  cd {ctx['cwd']}\n"
                f"  GPULAUNCH_JOB_ATTEMPT=@<job>/attempts/<n>.ctx.json {py} -m "
                "gpulaunch.jobs.attempt")

    def start(self, n: int, ctx: dict):
        ctx_file = write_ctx(self.job, n, ctx)
        env = dict(os.environ, GPULAUNCH_JOB_ATTEMPT=f"@{ctx_file}")
        fd = os.open(self.job.attempt_file(n, "log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                     0o600)
        try:
            proc = subprocess.Popen(
                self.argv(), cwd=ctx["cwd"], env=env, stdin=subprocess.DEVNULL, stdout=fd,
                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                preexec_fn=lambda: set_parent_death_signal(signal.SIGTERM))
        finally:
            os.close(fd)
        self.job.update_attempt(n, pid=proc.pid)
        self.job.update(state="RUNNING")
        return proc

    def poll(self, proc) -> dict | None:
        code = proc.poll()
        if code is None:
            return None
        n = self.job.record().get("attempt")
        return result_of(self.job, n, f"the attempt's process exited with code {code} "
                                      "without reporting a result")

    def stop(self, proc) -> None:
        if proc.poll() is not None:
            return
        grace = float(self.spec.launch.get("shutdown_grace") or 5.0)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace + STOP_EXTRA_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop_recorded(self, n: int | None) -> None:
        """Cancel without a supervisor (it died): end attempt ``n``'s process group."""
        pid = self.job.attempt(n).get("pid") if n else None
        if not pid:
            return
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"@{self.job.path}".encode() not in f.read():
                    return                     # the pid was reused by something else
            os.killpg(int(pid), signal.SIGTERM)
        except (OSError, ProcessLookupError):
            pass

    def live_state(self, record: dict) -> str | None:
        return None
