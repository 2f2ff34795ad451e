"""Preemption notices: how "this machine goes away in N seconds" travels to the ranks, and how
a rank says "I saved a checkpoint for it".

Two small files in the run directory, so that the caller, the node agent, the warm pool and
every rank (cold or warm) see the same thing without a new channel:

* ``preempt.json`` (the notice): written by whoever learns of the preemption (the caller on
  SIGTERM / SIGUSR1, ``handle.preempt()``, a cloud metadata poller through that call); every
  rank looks at it in ``rt.preemption()``, an ``os.stat`` per call, cheap enough for every
  step. It says when the notice came, the deadline, where it came from, and whether the run
  may be restarted here afterwards (not when the caller itself is being preempted).
* ``attempt<k>/preempted.json`` (the answer): rank 0 writes it once every rank has agreed on
  the notice and the checkpoint is complete (``parallel.save_on_preemption``). The node agent
  and the warm pool read it to tell a preempted attempt from a failed one: the first is counted
  against ``max_preemptions``, never against ``max_restarts``.

Modelled on Ray Train's ``get_preemption_info()`` (a notice the loop polls) and its separate
``max_preemption_failures`` budget. No torch here: the caller and the agent import it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

GRACE_ENV = "GPULAUNCH_PREEMPT_GRACE_S"          # the notice's grace period (caller and ranks)
MAX_PREEMPTIONS_ENV = "GPULAUNCH_MAX_PREEMPTIONS"
DEFAULT_MAX_PREEMPTIONS = 0     # by default a preempted run stops; the next start resumes
NOTICE_FILE = "preempt.json"
SAVED_FILE = "preempted.json"


@dataclasses.dataclass(frozen=True)
class PreemptionNotice:
    """A preemption notice as a rank sees it (``rt.preemption()``).

    ``deadline`` is a ``time.time()`` value: everything (the checkpoint included) must be done
    by then; ``remaining()`` is the seconds left. ``restart``: whether this run restarts here
    after the checkpoint (False when the whole caller is going away: the next start resumes)."""

    source: str
    received_at: float
    deadline: float
    restart: bool = False

    @property
    def grace_s(self) -> float:
        return self.deadline - self.received_at

    def remaining(self) -> float:
        return self.deadline - time.time()


def _write_json(path: Path, data: dict) -> None:
    """Atomic and owner-only: a reader sees the whole notice or none."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def post_notice(run_dir, grace_s: float, *, source: str, restart: bool) -> PreemptionNotice:
    """Tell every rank of the run in ``run_dir`` that it is preempted in ``grace_s`` seconds.
    A second notice never extends the first one's deadline."""
    now = time.time()
    earlier = read_notice(run_dir)
    if earlier is not None and earlier.deadline <= now + grace_s:
        return earlier
    notice = PreemptionNotice(source=source, received_at=now, deadline=now + float(grace_s),
                              restart=bool(restart))
    _write_json(Path(run_dir) / NOTICE_FILE, dataclasses.asdict(notice))
    return notice


def read_notice(run_dir) -> PreemptionNotice | None:
    try:
        data = json.loads((Path(run_dir) / NOTICE_FILE).read_text())
        return PreemptionNotice(**data)
    except (OSError, ValueError, TypeError):
        return None


def archive_notice(run_dir, attempt: int) -> None:
    """The attempt that the notice was for is over and the run restarts: move the notice into
    that attempt's folder, so that the next attempt starts without one."""
    src = Path(run_dir) / NOTICE_FILE
    try:
        os.replace(src, Path(run_dir) / f"attempt{attempt}" / NOTICE_FILE)
    except OSError:
        try:
            src.unlink()
        except OSError:
            pass


def write_saved(run_dir, attempt: int, *, step: int, checkpoint: str,
                notice: PreemptionNotice) -> dict:
    """Rank 0, once the checkpoint for the notice is complete on every rank."""
    data = {"step": int(step), "checkpoint": str(checkpoint), "saved_at": time.time(),
            "notice": dataclasses.asdict(notice)}
    path = Path(run_dir) / f"attempt{attempt}"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    _write_json(path / SAVED_FILE, data)
    return data


def read_saved(run_dir, attempt: int) -> dict | None:
    """What rank 0 wrote for attempt ``attempt`` (None: that attempt was not preempted)."""
    try:
        return json.loads((Path(run_dir) / f"attempt{attempt}" / SAVED_FILE).read_text())
    except (OSError, ValueError):
        return None


def env_float(env, name: str) -> float | None:
    value = (env or {}).get(name)
    try:
        return float(value) if value not in (None, "") else None
    except ValueError:
        return None


def max_preemptions(env) -> int:
    value = env_float(env, MAX_PREEMPTIONS_ENV)
    return int(value) if value is not None else DEFAULT_MAX_PREEMPTIONS


class RankView:
    """``rt.preemption()``: the notice for this rank's run, read again only when the file
    changes (one ``os.stat`` per call otherwise)."""

    def __init__(self):
        self._key: tuple | None = None
        self._notice: PreemptionNotice | None = None

    def current(self) -> PreemptionNotice | None:
        run_dir = os.environ.get("GPULAUNCH_RUN_DIR")
        if not run_dir:
            return None
        path = os.path.join(run_dir, NOTICE_FILE)
        try:
            st = os.stat(path)
        except OSError:
            self._key, self._notice = None, None
            return None
        key = (path, st.st_mtime_ns, st.st_ino)
        if key != self._key:
            self._key, self._notice = key, read_notice(run_dir)
        return self._notice


RANK_VIEW = RankView()
