"""A job's folder under the gpulaunch home: the only record of a job, read by every command.

    <home>/jobs/<job_id>/            mode 0700, files 0600
        spec.json                    the resolved spec (after --override), as it was submitted
        job.json                     state, target, supervisor pid, MLflow run, hashes, key
        supervisor.log               the supervisor's own lines (state changes, causes, pip)
        attempts/<n>.json            attempt n: state, cause, run dir, MLflow run, target id
        attempts/<n>.log             attempt n's output: every rank's lines, ``[rank N]`` first
        cancel                       present once `gpulaunch job cancel` asked
    <home>/jobs/keys/<sha256>        idempotency key -> job id (created exclusively)
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import os
import secrets
import time
from pathlib import Path

from ..common import rundir
from ..common.rundir import read_json, write_json_atomic
from ..errors import ConfigurationError


class JobState(str, enum.Enum):
    SUBMITTED = "SUBMITTED"        # folder written, supervisor starting
    PREPARING = "PREPARING"        # building the environment
    PENDING = "PENDING"            # waiting for the target (Slurm queue, Ray placement)
    RUNNING = "RUNNING"
    RETRYING = "RETRYING"          # an attempt failed; waiting out the backoff
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


def jobs_root() -> Path:
    return rundir.home() / "jobs"


def _private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)


class JobDir:
    def __init__(self, path: os.PathLike | str):
        self.path = Path(path)
        self.job_id = self.path.name

    spec_file = property(lambda self: self.path / "spec.json")
    record_file = property(lambda self: self.path / "job.json")
    supervisor_log = property(lambda self: self.path / "supervisor.log")
    cancel_file = property(lambda self: self.path / "cancel")
    attempts_dir = property(lambda self: self.path / "attempts")

    def record(self) -> dict:
        return read_json(self.record_file, {}) or {}

    def update(self, **fields) -> dict:
        """Merge ``fields`` into job.json (only the supervisor and ``job run`` write it)."""
        rec = self.record()
        rec.update(fields)
        rec["updated"] = time.time()
        write_json_atomic(self.record_file, rec)
        return rec

    def state(self) -> JobState:
        return JobState(self.record().get("state", JobState.SUBMITTED.value))

    def spec(self):
        from .spec import JobSpec
        return JobSpec.from_json(read_json(self.spec_file))

    def attempt_file(self, n: int, suffix: str = "json") -> Path:
        return self.attempts_dir / f"{n}.{suffix}"

    def attempt(self, n: int) -> dict:
        return read_json(self.attempt_file(n), {}) or {}

    def attempt_live(self, n: int) -> dict:
        """Attempt ``n`` as the supervisor recorded it, with what the attempt's process wrote
        itself (its run directory, as soon as its ranks start) filling the gaps."""
        own = read_json(self.attempt_file(n, "result.json"), {}) or {}
        own.pop("state", None)
        return {**own, **self.attempt(n)}

    def update_attempt(self, n: int, **fields) -> dict:
        rec = self.attempt(n)
        rec.update(fields, attempt=n)
        write_json_atomic(self.attempt_file(n), rec)
        return rec

    def attempts(self) -> list[dict]:
        if not self.attempts_dir.exists():
            return []
        numbers = sorted(int(p.stem) for p in self.attempts_dir.glob("*.json")
                         if p.stem.isdigit())
        return [self.attempt(n) for n in numbers]

    def log(self, text: str) -> None:
        """A line in supervisor.log (timestamped)."""
        stamp = time.strftime("%H:%M:%S")
        fd = os.open(self.supervisor_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(f"{stamp} {text}\n")


def new_job_id(name: str) -> str:
    return f"{name[:40]}-{time.strftime('%m%d%H%M')}-{secrets.token_hex(3)}"


def _key_file(key: str) -> Path:
    return jobs_root() / "keys" / hashlib.sha256(key.encode()).hexdigest()


def claim_key(key: str, job_id: str) -> str | None:
    """Bind ``key`` to ``job_id`` unless it is bound already; returns the job that holds it
    (None: ours now). Exclusive create, so two submissions racing with one key get one job."""
    path = _key_file(key)
    _private_dir(path.parent)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        deadline = time.monotonic() + 5
        while True:          # the winner writes its id right after creating the file
            held = path.read_text().strip()
            if held or time.monotonic() > deadline:
                return held or "(unknown)"
            time.sleep(0.05)
    with os.fdopen(fd, "w") as f:
        f.write(job_id)
    return None


def release_key(key: str, job_id: str) -> None:
    """A submission that failed before its job existed gives its key back."""
    path = _key_file(key)
    try:
        if path.read_text().strip() == job_id:
            path.unlink()
    except OSError:
        pass


def create(spec, *, job_id: str, key: str | None, extra: dict) -> JobDir:
    rundir.ensure_home()
    _private_dir(jobs_root())
    job = JobDir(jobs_root() / job_id)
    job.path.mkdir(mode=0o700)
    _private_dir(job.attempts_dir)
    write_json_atomic(job.spec_file, dataclasses.asdict(spec))
    job.update(job_id=job_id, name=spec.name, state=JobState.SUBMITTED.value,
               submitted=time.time(), where=spec.compute.where, idempotency_key=key,
               max_attempts=spec.retry.max_retries + 1, **extra)
    return job


def all_jobs() -> list[JobDir]:
    root = jobs_root()
    if not root.exists():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name != "keys"
            and (p / "job.json").exists()]
    dirs.sort(key=lambda p: (read_json(p / "job.json", {}) or {}).get("submitted", 0))
    return [JobDir(p) for p in dirs]


def find(ref: str) -> JobDir:
    """A job by id, unique prefix, or 'last'."""
    jobs = all_jobs()
    if ref == "last" and jobs:
        return jobs[-1]
    exact = [j for j in jobs if j.job_id == ref]
    matches = exact or [j for j in jobs if j.job_id.startswith(ref)]
    if len(matches) == 1:
        return matches[0]
    raise ConfigurationError(f"no single job matches {ref!r} under {jobs_root()} "
                             f"({len(matches)} match); see `gpulaunch job list`")
