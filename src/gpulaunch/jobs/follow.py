"""A job's logs, read back (``job logs``) or followed as they grow (``job logs -f``,
``job run --watch``). Both print the same text: each attempt's log under an
``=== attempt N ===`` header, every rank's line prefixed ``[rank N]`` as the launch streamed
it; ``--rank N`` keeps that rank's lines, without the prefix. State changes of a followed
job go to stderr, so stdout stays equal to ``job logs``.
"""

from __future__ import annotations

import re
import sys
import time
from typing import Callable, Iterator

from .attempt import MARKER
from .store import JobDir, JobState

POLL_S = 0.2


def header(n: int) -> str:
    return f"=== attempt {n} ==="


# "[rank 3] ..." from one host; "[node 1 rank 3] ..." from a launch over a Ray cluster
_PREFIX = re.compile(r"^\[(?:node \d+ )?rank (\d+)\] ")


def _keep(line: str, rank: int | None) -> str | None:
    if line.startswith(MARKER):
        return None
    if rank is None:
        return line
    m = _PREFIX.match(line)
    return line[m.end():] if m and int(m.group(1)) == rank else None


def lines(job: JobDir, *, attempt: int | None = None, rank: int | None = None) -> Iterator[str]:
    numbers = [a["attempt"] for a in job.attempts()]
    if attempt is not None:
        numbers = [n for n in numbers if n == attempt]
    for n in numbers:
        if attempt is None and rank is None:
            yield header(n)
        try:
            text = job.attempt_file(n, "log").read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            kept = _keep(line, rank)
            if kept is not None:
                yield kept


class _Tail:
    def __init__(self, path):
        self.path = path
        self.offset = 0
        self.partial = b""

    def read(self, final: bool) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        data = self.partial + data
        parts = data.split(b"\n")
        self.partial = parts.pop()
        if final and self.partial:
            parts.append(self.partial)
            self.partial = b""
        return [p.decode(errors="replace") for p in parts]


def follow(job: JobDir, *, rank: int | None = None, attempt: int | None = None,
           write: Callable[[str], None] | None = None,
           status: Callable[[str], None] | None = None) -> JobState:
    """Print the job's log as it grows until the job ends; returns its end state."""
    write = write or (lambda s: (sys.stdout.write(s + "\n"), sys.stdout.flush()))
    status = status or (lambda s: print(f"gpulaunch: {s}", file=sys.stderr, flush=True))
    tails: dict[int, _Tail] = {}
    seen_state = None
    reported: set[int] = set()
    while True:
        rec = job.record()
        state = JobState(rec.get("state", "SUBMITTED"))
        if state.value != seen_state:
            seen_state = state.value
            status(f"job {job.job_id}: {state.value}")
        final = state.terminal
        for a in job.attempts():
            n = a["attempt"]
            if attempt is not None and n != attempt:
                continue
            if n not in tails:
                tails[n] = _Tail(job.attempt_file(n, "log"))
                if attempt is None and rank is None:
                    write(header(n))
            done = a.get("state") in ("SUCCEEDED", "FAILED", "CANCELLED")
            for line in tails[n].read(final or done):
                kept = _keep(line, rank)
                if kept is not None:
                    write(kept)
            if done and n not in reported:
                reported.add(n)
                status(f"attempt {n}: {a['state']}"
                       + (f": {a['cause']}" if a.get("cause") else ""))
        if final:
            return state
        time.sleep(POLL_S)
