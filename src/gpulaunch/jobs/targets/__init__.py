"""Where a job's attempts run. Every target has the same small surface, used by the
supervisor and by ``--dry-run``:

    prepare(cancelled)   the environment, before any attempt (fails early: pip's error)
    start(n, ctx)        start attempt n; returns a handle
    poll(handle)         None while it runs, else the attempt's record (state, cause, ...)
    stop(handle)         cancel it; returns once nothing of it is left
    plan(ctx)            what start() would do, as text (``job run --dry-run``)
    live_state(record)   the target's own view of an attempt (``job get``), or None
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ..store import JobDir

LOG_TAIL_LINES = 20
CAUSE_MAX_CHARS = 3000


def for_spec(spec, job: JobDir):
    where = spec.compute.where
    if where == "slurm":
        from .slurm import SlurmTarget
        return SlurmTarget(spec, job)
    if where == "ray":
        from .ray import RayTarget
        return RayTarget(spec, job)
    from .local import LocalTarget
    return LocalTarget(spec, job)


def write_ctx(job: JobDir, n: int, ctx: dict) -> Path:
    """The attempt's context in an owner-only file (the spec's env values stay off argv)."""
    path = job.attempt_file(n, "ctx.json")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump(ctx, f)
    return path


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    from ..attempt import MARKER
    return "\n".join(line for line in text[-lines:] if not line.startswith(MARKER))


def bounded_cause(text: str, where: str, limit: int = CAUSE_MAX_CHARS) -> str:
    """A cause of at most about ``limit`` characters: its head (what failed) and its tail (the
    last error, where pip and tracebacks put theirs). A runtime environment that fails on a
    full disk makes Ray answer with one line per file it could not copy, 100 KB and more;
    the whole text stays in ``where`` for whoever needs it."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return (f"{text[:half]}\n... ({len(text) - 2 * half} characters left out; the whole "
            f"message is in {where}) ...\n{text[-half:]}")


def result_of(job: JobDir, n: int, fallback_cause: str) -> dict:
    """The attempt's own record when it wrote a final one, else a failure with
    ``fallback_cause`` and the end of its log."""
    rec: dict = {}
    path = job.attempt_file(n, "result.json")
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    if rec.get("state") in ("SUCCEEDED", "FAILED", "CANCELLED"):
        return rec
    tail = log_tail(job.attempt_file(n, "log"))
    cause = fallback_cause + (f"; its log ends:\n{tail}" if tail else "")
    return {**rec, "state": "FAILED", "cause": cause, "ended": time.time()}
