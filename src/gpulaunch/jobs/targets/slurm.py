"""Attempts on Slurm: each attempt is its own sbatch job (a retry gets a fresh allocation, so a
bad node is not reused by force), whose script runs one attempt process per node with srun;
every node's attempt joins the same launch (``cli_nodes.placement`` reads Slurm's variables).

The supervisor stays on the submitting host and follows the Slurm job with ``scontrol``
(``sacct`` once slurmctld has forgotten it); cancel is ``scancel``. The job's folder, the
snapshot and a built venv live under the gpulaunch home, which the nodes must see (as they
see $HOME on most clusters); the attempt writes its result there.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time

from .. import environment
from ..store import JobState
from . import result_of, write_ctx

ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED",
          "RESIZING", "SIGNALING", "STAGE_OUT")
STOP_WAIT_S = 120.0


def _run(argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def slurm_state(job_id: str) -> tuple[str | None, str]:
    """(state, reason) of a Slurm job; (None, why) when Slurm no longer knows it."""
    p = _run(["scontrol", "show", "job", "-o", str(job_id)])
    if p.returncode == 0 and "JobState=" in p.stdout:
        state = re.search(r"JobState=(\S+)", p.stdout).group(1)
        reason = re.search(r"Reason=(\S+)", p.stdout)
        return state, reason.group(1) if reason else ""
    p = _run(["sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "State"])
    if p.returncode == 0 and p.stdout.strip():
        return p.stdout.split()[0].split()[0], ""
    return None, (p.stderr or p.stdout).strip()


class SlurmTarget:
    def __init__(self, spec, job):
        self.spec = spec
        self.job = job
        self.python = None
        self._n = None

    def prepare(self, cancelled) -> None:
        # on this host, before sbatch: a failing install never waits in the queue
        self.python = environment.python_for(self.spec, log=self.job.log, cancelled=cancelled)

    def script(self, n: int, ctx_ref: str, cwd: str) -> str:
        c, s = self.spec.compute, self.spec.compute.slurm
        lines = ["#!/bin/bash", f"#SBATCH --job-name={self.job.job_id}-a{n}",
                 f"#SBATCH --nodes={c.nodes}", "#SBATCH --ntasks-per-node=1",
                 f"#SBATCH --output={self.job.attempt_file(n, 'log')}",
                 "#SBATCH --open-mode=append"]
        if s.request_gpus and c.gpus:
            lines.append(f"#SBATCH --gpus-per-node={c.gpus}")
        for key in ("partition", "account", "qos", "time"):
            if getattr(s, key):
                lines.append(f"#SBATCH --{key}={getattr(s, key)}")
        lines += [f"#SBATCH {opt}" for opt in s.sbatch]
        python = self.python or (self.spec.environment.python or "python")
        lines += ["# gpulaunch job: one attempt process per node; together they run one launch",
                  f"cd {shlex.quote(cwd)}",
                  f"export GPULAUNCH_JOB_ATTEMPT={shlex.quote(ctx_ref)}",
                  f"exec srun --ntasks-per-node=1 --kill-on-bad-exit=1 {shlex.quote(python)} "
                  "-m gpulaunch.jobs.attempt", ""]
        return "\n".join(lines)

    def plan(self, ctx: dict) -> str:
        return ("sbatch (one per attempt) of:\n"
                + self.script(1, "@<job>/attempts/1.ctx.json", ctx["cwd"]))

    def start(self, n: int, ctx: dict) -> str:
        ctx_file = write_ctx(self.job, n, ctx)
        path = self.job.attempt_file(n, "sbatch")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(self.script(n, f"@{ctx_file}", ctx["cwd"]))
        p = _run(["sbatch", "--parsable", str(path)], timeout=120)
        if p.returncode != 0:
            raise RuntimeError(f"sbatch refused the job: {(p.stderr or p.stdout).strip()}")
        slurm_id = p.stdout.strip().split(";")[0]
        self._n = n
        self.job.update_attempt(n, slurm_job_id=slurm_id)
        self.job.log(f"attempt {n}: Slurm job {slurm_id}")
        return slurm_id

    def poll(self, slurm_id: str) -> dict | None:
        state, reason = slurm_state(slurm_id)
        if state in ACTIVE:
            want = JobState.PENDING if state == "PENDING" else JobState.RUNNING
            if self.job.state() is not want:
                self.job.update(state=want.value)
            return None
        why = f"Slurm job {slurm_id} ended {state or 'unknown'}" + \
            (f" ({reason})" if reason and reason != "None" else "")
        rec = result_of(self.job, self._n, why + " before the attempt reported a result")
        rec["slurm_state"] = state
        if state == "CANCELLED" and rec.get("state") != "SUCCEEDED":
            rec.update(state="CANCELLED", cause=rec.get("cause") or why)
        return rec

    def stop(self, slurm_id: str) -> None:
        _run(["scancel", str(slurm_id)])
        deadline = time.monotonic() + STOP_WAIT_S
        while time.monotonic() < deadline:
            state, _ = slurm_state(slurm_id)
            if state not in ACTIVE:
                return
            time.sleep(0.5)

    def stop_recorded(self, n: int | None) -> None:
        slurm_id = self.job.attempt(n).get("slurm_job_id") if n else None
        if slurm_id:
            self._n = n
            self.stop(slurm_id)

    def live_state(self, record: dict) -> str | None:
        slurm_id = record.get("slurm_job_id")
        return slurm_state(slurm_id)[0] if slurm_id else None
