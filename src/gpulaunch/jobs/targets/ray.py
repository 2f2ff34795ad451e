"""Attempts on a Ray cluster, through Ray's job submission API: each attempt is a Ray job whose
entrypoint is the attempt process, with the code snapshot as its ``working_dir`` and the
requirements as its ``pip`` runtime environment (Ray builds and caches that environment on
the cluster; a failing install fails the Ray job before the entrypoint runs, and Ray's message
carries pip's error). Inside, the launch places its ranks over the cluster
(``remote=True, cluster='auto'``), as ``@distributed(remote=True)`` does.

The supervisor stays on the submitting host: it polls the job's status, copies its logs into
the job's folder (``job logs`` works without the cluster afterwards), and reads the attempt's
result from the last log line the attempt prints. Cancel is ``stop_job``.
"""

from __future__ import annotations

import json
import os
import shlex
import time

from ..attempt import ENV, MARKER
from ..store import JobState
from . import bounded_cause

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
LOG_EVERY_S = 2.0
STOP_WAIT_S = 120.0
SUBMIT_RETRY_S = 120.0


class RayTarget:
    def __init__(self, spec, job):
        self.spec = spec
        self.job = job
        self.address = spec.compute.ray.address or os.environ.get("RAY_ADDRESS")
        self._c = None
        self._n = None
        self._logged = 0.0

    def client(self):
        if self._c is None:
            from ray.job_submission import JobSubmissionClient
            self._c = JobSubmissionClient(self.address)
        return self._c

    def prepare(self, cancelled) -> None:
        self.client()            # an unreachable job server fails the job before attempt 1

    def submission(self, n: int, ctx: dict) -> dict:
        sent = {k: v for k, v in ctx.items() if k not in ("result_file", "cwd")}
        runtime_env = {"working_dir": ctx["cwd"], "env_vars": {ENV: json.dumps(sent)}}
        if self.spec.environment.requirements:
            runtime_env["pip"] = list(self.spec.environment.requirements)
        python = self.spec.environment.python or "python"
        return {"entrypoint": f"{shlex.quote(python)} -m gpulaunch.jobs.attempt",
                "submission_id": f"{self.job.job_id}-a{n}", "runtime_env": runtime_env,
                "metadata": {"gpulaunch_job": self.job.job_id, "attempt": str(n)}}

    def plan(self, ctx: dict) -> str:
        sub = self.submission(1, ctx)
        sub["runtime_env"]["env_vars"][ENV] = "<the resolved spec and attempt, as JSON>"
        return (f"Ray job submission to {self.address or '$RAY_ADDRESS'} (one per attempt):\n"
                + json.dumps(sub, indent=1))

    def start(self, n: int, ctx: dict) -> str:
        sub = self.submission(n, ctx)
        deadline = time.monotonic() + SUBMIT_RETRY_S
        while True:
            try:
                sid = self.client().submit_job(**sub)
                break
            except RuntimeError as e:
                # a head whose dashboard agent has not registered yet answers "try again later"
                if "try again" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(2.0)
        self._n = n
        self.job.update_attempt(n, ray_submission_id=sid)
        self.job.log(f"attempt {n}: Ray job {sid} at {self.address}")
        return sid

    def _copy_logs(self, sid: str) -> str:
        text = self.client().get_job_logs(sid)
        path = self.job.attempt_file(self._n, "log")
        tmp = path.with_name(f".{path.name}.tmp")
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(text)
        os.replace(tmp, path)
        self._logged = time.monotonic()
        return text

    def poll(self, sid: str) -> dict | None:
        status = str(self.client().get_job_status(sid)).rsplit(".", 1)[-1]
        if status not in TERMINAL:
            want = JobState.PENDING if status == "PENDING" else JobState.RUNNING
            if self.job.state() is not want:
                self.job.update(state=want.value)
            if time.monotonic() - self._logged > LOG_EVERY_S:
                self._copy_logs(sid)
            return None
        text = self._copy_logs(sid)
        rec = None
        for line in reversed(text.splitlines()):
            if line.startswith(MARKER):
                rec = json.loads(line[len(MARKER):])
                break
        if rec is None:
            # ended before the attempt printed its record (its runtime environment failed, or
            # it was stopped): Ray's own message says why; the whole of it goes to the log
            info = self.client().get_job_info(sid)
            why = f"Ray job {sid} ended {status}: {(info.message or '').strip()}"
            path = self.job.attempt_file(self._n, "log")
            with open(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "a") as f:
                f.write(("\n" if text and not text.endswith("\n") else "") + why + "\n")
            cause = bounded_cause(why, f"the attempt's log (gpulaunch job logs {self.job.job_id})")
            rec = {"state": "CANCELLED" if status == "STOPPED" else "FAILED", "cause": cause,
                   "ended": time.time()}
        rec["ray_status"] = status
        return rec

    def stop(self, sid: str) -> None:
        self.client().stop_job(sid)
        deadline = time.monotonic() + STOP_WAIT_S
        while time.monotonic() < deadline:
            if str(self.client().get_job_status(sid)).rsplit(".", 1)[-1] in TERMINAL:
                return
            time.sleep(0.5)

    def stop_recorded(self, n: int | None) -> None:
        sid = self.job.attempt(n).get("ray_submission_id") if n else None
        if sid:
            self._n = n
            self.stop(sid)

    def live_state(self, record: dict) -> str | None:
        sid = record.get("ray_submission_id")
        return str(self.client().get_job_status(sid)).rsplit(".", 1)[-1] if sid else None
