"""The job's supervisor: a detached process on the submitting host that owns the job from
submission to its end state. It survives the terminal that submitted it (its own session, a
second fork so no terminal can claim it again, SIGHUP ignored) and:

1. prepares the environment (a failing pip install ends the job here, before any attempt);
2. runs attempt after attempt on the target until one succeeds or ``retry.max_retries`` are
   spent, pausing ``retry.pause(k)`` seconds between them;
3. records each attempt's state and root cause (attempts/<n>.json and its MLflow run) and the
   job's end state.

``gpulaunch job cancel`` touches ``cancel`` and sends SIGTERM; the supervisor then stops the
running attempt through its target and ends CANCELLED.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from .store import JobDir, JobState

POLL_S = 0.5


class Supervisor:
    def __init__(self, job: JobDir):
        self.job = job
        self.spec = job.spec()
        self._cancel = False

    def cancelled(self) -> bool:
        return self._cancel or self.job.cancel_file.exists()

    def on_signal(self, signum, frame) -> None:
        self._cancel = True

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self.cancelled() and time.monotonic() < end:
            time.sleep(min(POLL_S, max(0.0, end - time.monotonic())))

    def ctx(self, n: int, runs) -> dict:
        rec = self.job.record()
        return {"spec": self.spec.to_json(), "job_id": self.job.job_id, "attempt": n,
                "result_file": str(self.job.attempt_file(n, "result.json")),
                "tracking": runs.enabled, "environ": runs.environ(), "cwd": rec["code_path"],
                "job_dir": str(self.job.path) if self.spec.compute.where != "ray" else None}

    def run(self) -> JobState:
        from .environment import EnvironmentBuildError
        from .mlflow_runs import JobRuns
        from .targets import for_spec
        job, spec = self.job, self.spec
        job.update(state=JobState.PREPARING.value, supervisor_pid=os.getpid(),
                   supervisor_started=time.time())
        job.log(f"supervisor {os.getpid()} for job {job.job_id} ({spec.compute.where})")
        runs = JobRuns(spec, job)
        if runs.run_id:
            job.update(mlflow_run_id=runs.run_id, mlflow_tracking_uri=runs.uri)
        target = for_spec(spec, job)
        state, cause = JobState.FAILED, None
        try:
            target.prepare(self.cancelled)
        except EnvironmentBuildError as e:
            cause = f"environment: {e}"
            job.update(attempt=1)
            rec = job.update_attempt(1, state="FAILED", cause=cause, started=time.time(),
                                     ended=time.time())
            runs.attempt_done(1, rec)
            return self._end(runs, JobState.FAILED, cause)
        except InterruptedError:
            return self._end(runs, JobState.CANCELLED, "cancelled while preparing")
        except Exception as e:  # noqa: BLE001 - the target unreachable: the job's cause
            return self._end(runs, JobState.FAILED, f"{spec.compute.where}: "
                             f"{type(e).__name__}: {e}")
        attempts = spec.retry.max_retries + 1
        for n in range(1, attempts + 1):
            if self.cancelled():
                state, cause = JobState.CANCELLED, "cancelled"
                break
            job.update(state=JobState.PENDING.value, attempt=n)
            job.update_attempt(n, state="STARTING", started=time.time())
            rec = self._one(target, n, runs)
            rec = job.update_attempt(n, **rec)
            run_id = runs.attempt_done(n, rec)
            if run_id:
                job.update_attempt(n, mlflow_run_id=run_id)
            job.log(f"attempt {n}/{attempts}: {rec['state']}"
                    + (f": {rec.get('cause')}" if rec.get("cause") else ""))
            state, cause = JobState(rec["state"]), rec.get("cause")
            if state is JobState.SUCCEEDED or self.cancelled():
                if self.cancelled():
                    state = JobState.CANCELLED
                break
            if n < attempts:
                pause = spec.retry.pause(n)
                job.update(state=JobState.RETRYING.value, next_attempt_at=time.time() + pause)
                job.log(f"retrying in {pause:g} s")
                self._sleep(pause)
        return self._end(runs, state, cause)

    def _one(self, target, n: int, runs) -> dict:
        try:
            handle = target.start(n, self.ctx(n, runs))
        except Exception as e:  # noqa: BLE001 - sbatch refused, Ray unreachable: a cause
            return {"state": "FAILED", "cause": f"could not start: {type(e).__name__}: {e}",
                    "ended": time.time()}
        while True:
            rec = target.poll(handle)
            if rec is not None:
                return rec
            if self.cancelled():
                self.job.log(f"cancel: stopping attempt {n}")
                target.stop(handle)
                rec = target.poll(handle) or {}
                return {**rec, "state": "CANCELLED",
                        "cause": rec.get("cause") if rec.get("state") == "CANCELLED"
                        else "cancelled", "ended": time.time()}
            time.sleep(POLL_S)

    def _end(self, runs, state: JobState, cause: str | None) -> JobState:
        self.job.update(state=state.value, ended=time.time(), cause=cause)
        runs.end(state.value, cause)
        self.job.log(f"job {state.value}" + (f": {cause}" if cause else ""))
        return state


def spawn(job: JobDir) -> int:
    """Start the supervisor detached; returns once it runs on its own (its pid)."""
    log = os.open(job.supervisor_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        first = subprocess.Popen([sys.executable, "-m", "gpulaunch.jobs.supervisor", "--detach",
                                  str(job.path)], stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True,
                                 close_fds=True)
    finally:
        os.close(log)
    first.wait(timeout=60)     # the intermediate process exits as soon as it has forked
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        pid = job.record().get("supervisor_pid")
        if pid:
            return int(pid)
        time.sleep(0.05)
    raise RuntimeError(f"the supervisor of {job.job_id} did not start; see {job.supervisor_log}")


def main(argv: list[str]) -> int:
    detach = argv[:1] == ["--detach"]
    job = JobDir(argv[-1])
    if detach:
        if os.fork() > 0:
            os._exit(0)        # the intermediate: its child is re-parented, no terminal
        os.umask(0o077)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    sup = Supervisor(job)
    job.update(supervisor_pid=os.getpid())
    signal.signal(signal.SIGTERM, sup.on_signal)
    signal.signal(signal.SIGINT, sup.on_signal)
    try:
        state = sup.run()
    except BaseException as e:  # noqa: BLE001 - a supervisor bug must still end the job
        import traceback
        job.log("supervisor failed:\n" + traceback.format_exc())
        job.update(state=JobState.FAILED.value, ended=time.time(),
                   cause=f"the supervisor failed: {type(e).__name__}: {e}")
        return 1
    return 0 if state is JobState.SUCCEEDED else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
