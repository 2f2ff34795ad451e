"""What a fault-tolerant run reports: each replica group's failures, and the files the
groups write as they go (one JSON line per committed step, one pid file per rank).

    result.failures[0]      # ReplicaFailure(replica=1, attempt=0, last_step=57, healed_to=58,
                            #                steps_missed=0, ...); .down_s: seconds it was away
    result.size_changes     # an elastic run: [SizeChange(step=20, from_size=2, to_size=1, ...)]
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .elastic import SizeChange


@dataclasses.dataclass
class ReplicaFailure:
    """One failure of one replica group, as the caller saw it."""

    replica: int
    attempt: int                  # the attempt that failed (0: the first start)
    failed_at: float              # time.time() when the caller saw the group's run end
    error: str                    # the group's error, one line
    last_step: int | None         # the run's step at the group's last commit before it failed
    restarted: bool               # False: out of restarts, or the run was already finishing
    rejoined_at: float | None = None      # time of the next attempt's first committed step
    healed_to: int | None = None          # the step it received from a peer when it rejoined
    steps_missed: int | None = None       # run steps committed without this group

    @property
    def down_s(self) -> float | None:
        """Seconds from the failure being seen to the group's next committed step."""
        return None if self.rejoined_at is None else self.rejoined_at - self.failed_at


@dataclasses.dataclass
class ReplicasResult:
    """What :func:`run_replicas` returns."""

    results: dict[int, list]                    # replica -> per-rank results of its last attempt
    failures: list[ReplicaFailure]
    given_up: list[int]                         # replicas that ended failed
    lighthouse_restarts: int
    wall_s: float
    steps: dict[int, list[dict]] = dataclasses.field(default_factory=dict)  # replica -> commits
    # an elastic run (replicas=(min, max)): every change of its size, in order
    size_changes: list[SizeChange] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        lines = [f"{len(self.results)} replica group(s) finished in {self.wall_s:.1f} s; "
                 f"{len(self.failures)} failure(s); lighthouse restarts: "
                 f"{self.lighthouse_restarts}"]
        for f in self.failures:
            lines.append(f"  replica {f.replica} attempt {f.attempt}: {f.error}; last step "
                         f"{f.last_step}, healed to {f.healed_to}, missed {f.steps_missed}, "
                         f"down {f.down_s if f.down_s is None else round(f.down_s, 2)} s")
        for c in self.size_changes:
            lines.append(f"  size {c}")
        return "\n".join(lines)


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def read_steps(folder: Path, replica: int) -> list[dict]:
    """The committed-step records of one replica group (every attempt), in order."""
    path = Path(folder) / f"replica{replica}.steps.jsonl"
    out = []
    try:
        with open(path) as f:
            for line in f:
                if line.endswith("\n"):
                    out.append(json.loads(line))
    except FileNotFoundError:
        pass
    return out


def group_pids(folder: Path, replica: int, attempt: int) -> list[int]:
    """The rank processes of one attempt of one replica group (for fault injection)."""
    pids = []
    for p in Path(folder).glob(f"replica{replica}.attempt{attempt}.rank*.pid"):
        try:
            pids.append(int(p.read_text()))
        except (OSError, ValueError):
            pass
    return pids
