"""``RunHandle``: the caller's view of a started run (any backend's ``Run``)."""

from __future__ import annotations

import threading
import time

from ..common.records import RunState, StopReason
from ..errors import LaunchError
from . import preemption
from .logstream import tail_text
from .outcome import settle


def _lost_track(run, e: BaseException) -> LaunchError:
    """The error for a run whose following failed in the caller (not in a rank)."""
    return LaunchError(f"gpulaunch lost track of run {run.run.run_id} while following it "
                       f"({type(e).__name__}: {e}); every rank was stopped. Run directory: "
                       f"{run.run.path}", run_dir=str(run.run.path))


def _stop_quietly(run) -> None:
    """Stop a run whose following failed. Stopping may hit the same fault (a deleted run
    directory, a lost connection); the caller gets the first."""
    try:
        run.stop(StopReason.CANCELLED)
    except Exception:  # noqa: BLE001
        pass
    finally:
        run.finished = True


class RunHandle:
    """A run in flight: ``status``, ``result()``, ``logs()``, ``cancel()``, ``run_dir``.

    ``background=True`` (``submit()``): a thread follows the run; otherwise the caller's own
    thread does, in ``wait()`` (``.distributed()``)."""

    def __init__(self, run, *, background: bool):
        self._run = run
        self.run_id = run.run.run_id
        self.run_dir = str(run.run.path)
        self._thread = None
        self._follow_error: BaseException | None = None
        if background:
            self._thread = threading.Thread(target=self._follow, name=f"gpulaunch-{self.run_id}",
                                            daemon=True)
            self._thread.start()

    def _follow(self) -> None:
        """Poll the run until it ends. If following fails (a bug of ours, a lost cluster
        connection), the run must not be left going unobserved with ``done()`` False forever:
        stop every rank and keep the error for ``result()``."""
        try:
            self._poll()
        except BaseException as e:  # noqa: BLE001 - reported by result()
            self._follow_error = e
            _stop_quietly(self._run)

    def _poll(self, timeout: float | None = None) -> bool:
        interval = self._run.poll_interval
        end = None if timeout is None else time.monotonic() + timeout
        while not self._run.advance():         # a poll, then the callbacks' on_poll
            if end is not None and time.monotonic() > end:
                return False
            self._run.pause(interval)
        return True

    @property
    def status(self) -> RunState:
        """PENDING, RUNNING, SUCCEEDED, FAILED, CANCELLED or TIMED_OUT (a str enum)."""
        return self._run.state

    @property
    def mlflow_run_id(self) -> str | None:
        """The MLflow run of this launch (None when tracking is off or its store failed)."""
        cb = self._run.callbacks.find("tracking") if self._run.callbacks is not None else None
        return cb.run_id() if cb is not None else None

    @property
    def panel(self):
        """The notebook panel's view of this run (None outside Jupyter or with panel=False)."""
        cb = self._run.callbacks.find("panel") if self._run.callbacks is not None else None
        return cb.view if cb is not None else None

    def done(self) -> bool:
        return self._run.finished

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the run ends (or ``timeout`` seconds pass); True if it ended."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return self._poll(timeout)

    def follow(self) -> list:
        """Follow the run in this thread to its end and return ``result()``; Ctrl-C or a
        notebook's stop button stops every rank. (``.distributed()`` is ``submit`` + this.)"""
        try:
            with preemption.notice_signals(self._run):   # SIGTERM/SIGUSR1: a notice, if on
                self._poll()
        except Exception as e:  # following failed (not the run): same as submit()
            _stop_quietly(self._run)
            raise _lost_track(self._run, e) from e
        except BaseException:   # KeyboardInterrupt: stop every rank, then let it propagate
            self._run.stop(StopReason.CANCELLED)
            raise
        return self.result()

    def result(self, timeout: float | None = None) -> list:
        """The per-rank results ordered by global rank, or the run's error raised here."""
        if not self.wait(timeout):
            raise TimeoutError(f"run {self.run_id} still running after {timeout} s "
                               "(this did not stop it; call cancel() to stop it)")
        if self._follow_error is not None:
            raise _lost_track(self._run, self._follow_error) from self._follow_error
        expired = preemption.expired_error(self._run)
        if expired is not None:
            raise expired
        return settle(self._run.outcome())

    def cancel(self) -> None:
        """Stop every rank now (SIGTERM, then SIGKILL after the grace period)."""
        self._run.stop(StopReason.CANCELLED)

    def preempt(self, grace_s: float | None = None, *, restart: bool = True,
                source: str = "handle.preempt()"):
        """A preemption notice for this run: every rank sees it (``rt.preemption()``) and saves
        a checkpoint (``parallel.save_on_preemption``) within ``grace_s`` seconds (default:
        ``preempt_grace=``, else 30). ``restart=True``: the run then restarts from it here
        (``max_preemptions``); False: it stops with ``PreemptedError``. The hook for a node
        drain or a cloud's preemption notice; returns the ``PreemptionNotice``."""
        return preemption.post(self._run, grace_s, source=source, restart=restart)

    @property
    def attempts(self) -> list:
        """Every earlier attempt of this run that ended before its last (``AttemptRecord``:
        ``attempt``, ``cause``, ``failures``, ``preempted``)."""
        try:
            return list(self._run.run.status(0).history)
        except Exception:  # noqa: BLE001 - no status yet
            return []

    @property
    def preemptions(self) -> int:
        """Attempts stopped by a preemption notice and restarted (``max_preemptions``)."""
        return sum(1 for a in self.attempts if a.preempted)

    @property
    def failures(self) -> int:
        """Attempts that failed and were restarted (``max_restarts``)."""
        return sum(1 for a in self.attempts if not a.preempted)

    def stacks(self, native: bool | None = None):
        """Every rank's current Python stack (rank -> text; ``print()`` it for the report in
        the ``HangError`` layout), for a run that is going; ``native``: add py-spy's native
        frames (default: when py-spy is installed)."""
        from .stacks import collect_stacks
        return collect_stacks(self._run.run, self._run.spec.world_size, native=native,
                              dump=self._run.dump_stacks)

    def logs(self, rank: int | None = None, lines: int | None = None) -> str:
        """The log of one rank, or of every rank (prefixed), from the latest attempt."""
        run = self._run.run
        attempts = run.attempts()
        if not attempts:
            return ""
        attempt = attempts[-1]
        ranks = [rank] if rank is not None else range(self._run.spec.world_size)
        chunks = []
        for r in ranks:
            text = tail_text(run.rank_file(attempt, r, "log"), lines or 10**9, max_bytes=1 << 26)
            if rank is not None:
                return text
            chunks.extend(f"[rank {r}] {line}" for line in text.splitlines())
        return "\n".join(chunks)

    def __repr__(self) -> str:
        return f"<RunHandle {self.run_id} {self.status}>"
