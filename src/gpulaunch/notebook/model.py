"""The live panel's state, built from the run directory alone (pure: no widgets, no kernel).

Everything the panel shows is already in the run directory, written by the ranks and their
agent: ``rank<r>.info.json`` (host, pid, local rank), ``rank<r>.log`` (the last line; a tqdm bar
redraws with ``\\r``, so the last redraw is the progress), ``rank<r>.result.pkl`` /
``.error.pkl`` (the rank's end), and ``rank<r>.metrics.jsonl`` (``runtime.report(...)``). So
the view (``view.py``) only renders a ``PanelState``, and this module is tested without Jupyter.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time

from ..caller.logstream import tail_text
from ..common.rundir import RunDir, hostname

# tqdm's default bar: " 42%|████▏     | 42/100 [00:01<00:02, 30.1it/s]"
_TQDM = re.compile(r"(\d+)%\|[^|]*\|\s*(\d+)/(\d+)(?:\s*\[[^,\]]*(?:<[^,\]]*)?,\s*"
                   r"([\d.]+)\s*([a-zA-Z/]+)\])?")
METRIC_TAIL_BYTES = 256 * 1024   # the metrics file is read from its end (a long run's is large)
HISTORY_POINTS = 200             # points per metric kept for the plot


@dataclasses.dataclass(frozen=True)
class Progress:
    done: int
    total: int
    rate: float | None = None        # items per second, when tqdm printed one
    unit: str = ""

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total else 0.0


@dataclasses.dataclass(frozen=True)
class RankRow:
    rank: int
    state: str                       # starting, running, finished, failed, debugging
    host: str = ""
    device: str = ""                 # "cuda:<local rank>" or "cpu"
    last_line: str = ""
    progress: Progress | None = None
    metrics: dict = dataclasses.field(default_factory=dict)   # latest value of each
    gpu: dict = dataclasses.field(default_factory=dict)       # NVML readings of its GPU


@dataclasses.dataclass(frozen=True)
class PanelState:
    run_id: str
    label: str
    world_size: int
    attempt: int
    elapsed: float
    timeout: float | None
    rows: tuple[RankRow, ...]
    history: dict = dataclasses.field(default_factory=dict)  # metric -> [(step, value)], rank 0
    outcome: str = ""                # set when the run is over: what replaces the live view

    def states(self) -> dict[int, str]:
        return {r.rank: r.state for r in self.rows}


def parse_progress(line: str) -> Progress | None:
    """The progress of the last tqdm redraw in ``line`` (None when it is not a tqdm bar)."""
    matches = list(_TQDM.finditer(line))
    if not matches:
        return None
    m = matches[-1]
    rate, unit = m.group(4), m.group(5) or ""
    value = float(rate) if rate else None
    if value is not None and unit.startswith("s/"):      # tqdm prints s/it below 1 it/s
        value, unit = (1.0 / value if value else None), unit[2:] + "/s"
    return Progress(int(m.group(2)), int(m.group(3)), value, unit)


def read_metrics(path) -> list[dict]:
    """The records of a ``rank<r>.metrics.jsonl`` (its end; a torn last line is skipped)."""
    text = tail_text(path, 10**9, max_bytes=METRIC_TAIL_BYTES)
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _rank_state(run: RunDir, attempt: int, rank: int) -> str:
    if run.rank_file(attempt, rank, "debug.json").exists():
        return "debugging"        # stopped at its error, waiting for `gpulaunch debug`
    if run.rank_file(attempt, rank, "error.pkl").exists():
        return "failed"
    if run.rank_file(attempt, rank, "result.pkl").exists():
        return "finished"
    if run.rank_file(attempt, rank, "info.json").exists():
        return "running"
    return "starting"


def build(run: RunDir, *, now: float | None = None, outcome: str = "",
          gpus: dict[int, dict] | None = None) -> PanelState:
    """The panel's state for ``run`` at this moment; ``gpus``: local rank -> NVML readings of
    this host's GPUs (``gpus.read``), shown on the rows of the ranks on this host."""
    record = run.launch()
    world = record.world_size if record else 1
    device = record.spec.device if record else "cpu"
    attempts = run.attempts()
    attempt = attempts[-1] if attempts else 0
    rows, history = [], {}
    for r in range(world):
        info = run.rank_info(attempt, r)
        lines = tail_text(run.rank_file(attempt, r, "log"), 1).splitlines()
        last = lines[-1].strip() if lines else ""
        records = read_metrics(run.rank_file(attempt, r, "metrics.jsonl"))
        latest = {}
        for rec in records:
            latest.update({k: v for k, v in rec.items() if k not in ("t", "step")})
        if r == 0:
            for i, rec in enumerate(records):
                step = rec.get("step", i)
                for k, v in rec.items():
                    if k not in ("t", "step"):
                        history.setdefault(k, []).append((step, v))
            history = {k: v[-HISTORY_POINTS:] for k, v in history.items()}
        rows.append(RankRow(
            rank=r, state=_rank_state(run, attempt, r), host=info.host if info else "",
            device=(f"cuda:{info.local_rank}" if device == "cuda" else "cpu") if info else "",
            last_line=last[-200:], progress=parse_progress(last), metrics=latest,
            gpu=(gpus or {}).get(info.local_rank, {}) if info and info.host == hostname()
            else {}))
    started = record.started if record and record.started else _created(run)
    ended = run.status().ended if outcome else None
    end = ended or (now if now is not None else time.time())
    return PanelState(run_id=run.run_id, label=record.label if record else run.run_id,
                      world_size=world, attempt=attempt, elapsed=max(0.0, end - started),
                      timeout=record.spec.timeout if record else None, rows=tuple(rows),
                      history=history, outcome=outcome)


def _created(run: RunDir) -> float:
    try:
        return run.launch_json.stat().st_mtime
    except OSError:
        return time.time()


def format_elapsed(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
