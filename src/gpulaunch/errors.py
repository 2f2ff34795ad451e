"""Every exception gpulaunch raises, in one place.

Two families, so callers can tell them apart:

* ``UserError``: the call itself was wrong (bad arguments, a GPU the host does not have, an
  argument that cannot be pickled). Raised before any process starts. Each also derives from
  the built-in exception a Python user would expect (``ValueError``/``TypeError``), so existing
  ``except ValueError`` code keeps working.
* ``RunError``: the run started and then failed for a reason that is not a Python exception
  raised by the user's function (a rank crashed, was killed, hung, timed out, was cancelled).

A Python exception raised inside a rank is re-raised in the caller *as itself* (its original
class), with the remote traceback chained as its ``__cause__``; only when that object cannot be
rebuilt does the caller get a ``RemoteError``.
"""

from __future__ import annotations


class GpulaunchError(Exception):
    """Base class of every error raised by gpulaunch."""


# --------------------------------------------------------------------------- user mistakes
class UserError(GpulaunchError):
    """The call was wrong; nothing was started."""


class ConfigurationError(UserError, ValueError):
    """Invalid decorator or launch settings (conflicting arguments, bad values)."""


class GPUValidationError(ConfigurationError):
    """The requested GPU count cannot be satisfied on this host."""


class GPUTypeError(ConfigurationError):
    """The requested GPU type is unknown or is not what this host has."""


class ArgumentError(UserError, TypeError):
    """The arguments do not match the function's signature."""


class StateDroppedError(GpulaunchError, KeyError):
    """``rt.state[key]`` read in a warm pool whose ranks restarted cold since the call that set
    it: the key was there, the process that held it is gone. Says why and what to re-run."""

    def __init__(self, key, why: str = "", loaded_by: str = ""):
        self.key, self.why, self.loaded_by = key, why, loaded_by
        again = f"re-run {loaded_by}" if loaded_by else "re-run the call that loads it"
        super().__init__(
            f"rt.state[{key!r}] is gone: the warm pool restarted cold"
            f"{f' ({why})' if why else ''} and the new ranks start with an empty rt.state. "
            f"Fix: {again} before this one.")

    def __str__(self) -> str:                     # KeyError would show the repr of the message
        return str(self.args[0])

    def __reduce__(self):                         # travels from the rank to the caller
        return (type(self), (self.key, self.why, self.loaded_by))


class SerializationError(UserError, TypeError):
    """The function, an argument or a return value cannot be pickled (or is too large)."""


class ResultLoadError(SerializationError):
    """A rank's return value reached the caller but cannot be unpickled here (a class only the
    ranks can import, a device this process lacks). ``rank`` and ``path`` (the raw pickle,
    kept) say which."""

    def __init__(self, message: str, *, rank: int | None = None, path: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.path = path


class WontFitError(ConfigurationError):
    """``plan=`` was given and the planner predicts the run would not fit in GPU memory."""


# Spellings used by the seed product (serverless_gpu / databricks.air), kept so ported code that
# catches them keeps working.
RuntimeConfigurationError = ConfigurationError


# --------------------------------------------------------------------------- run failures
class RunError(GpulaunchError):
    """The run started and did not finish successfully.

    Attributes give the root cause: ``rank`` (global rank that failed first, or None),
    ``host``, ``exit_code`` (the process exit code; negative means killed by that signal),
    ``log_tail`` (last lines that rank printed) and ``run_dir``.
    """

    def __init__(self, message: str, *, rank: int | None = None, host: str | None = None,
                 exit_code: int | None = None, log_tail: str = "", run_dir: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.host = host
        self.exit_code = exit_code
        self.log_tail = log_tail
        self.run_dir = run_dir


class WorkerCrashError(RunError):
    """A rank exited without a Python exception: ``os._exit``, ``sys.exit(n)``, a signal
    (SIGKILL from the OOM killer, SIGSEGV, ...)."""


class RemoteError(RunError):
    """A rank raised an exception whose object could not be rebuilt in the caller.

    ``remote_type`` is the exception's qualified class name and ``remote_traceback`` its
    traceback text as printed in the worker.
    """

    def __init__(self, message: str, *, remote_type: str = "", remote_traceback: str = "", **kw):
        super().__init__(message, **kw)
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback


class RunTimeoutError(RunError, TimeoutError):
    """The run exceeded the ``timeout=`` given to the decorator; every process was stopped."""


LocalExecutionTimeoutError = RunTimeoutError  # the seed product's name


class HangError(RunError):
    """The hang watchdog (``hang_timeout=``) saw a rank make no progress; the error message
    carries the Python stack of every rank at that moment (``stacks``: rank -> text)."""

    def __init__(self, message: str, *, stacks: dict[int, str] | None = None, **kw):
        super().__init__(message, **kw)
        self.stacks = stacks or {}


class RunCancelledError(RunError):
    """The run was cancelled (``handle.cancel()``) before it finished."""


class NodeLostError(WorkerCrashError):
    """A whole node of a multi-node run vanished (its machine, raylet or node agent died);
    ``node_rank`` says which. Every other node was stopped."""

    def __init__(self, message: str, *, node_rank: int | None = None, **kw):
        super().__init__(message, **kw)
        self.node_rank = node_rank


class PreemptedError(RunError):
    """The run was preempted (a notice with a grace period: SIGTERM or SIGUSR1 to the caller,
    ``handle.preempt()``) and stopped. ``step`` and ``checkpoint``: the checkpoint saved for the
    notice (None when none was complete within the grace period); the next start resumes from
    the newest complete checkpoint (``parallel.resume``)."""

    def __init__(self, message: str, *, step: int | None = None,
                 checkpoint: str | None = None, **kw):
        super().__init__(message, **kw)
        self.step = step
        self.checkpoint = checkpoint

    def __reduce__(self):                         # travels from the rank to the caller
        return (_rebuild_preempted, (self.args[0], self.step, self.checkpoint, self.rank))


def _rebuild_preempted(message, step, checkpoint, rank):
    return PreemptedError(message, step=step, checkpoint=checkpoint, rank=rank)


class LaunchError(RunError):
    """The processes could not be started (agent failed, rendezvous failed, ...)."""


class RemoteTraceback(Exception):
    """Carries a worker's traceback text; chained as ``__cause__`` of re-raised exceptions so
    Python prints the remote traceback right above the local one."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


# --------------------------------------------------------------------------- data input
class DataError(ConfigurationError):
    """Data the run was pointed at cannot be read as asked (gpulaunch.data): a missing file or
    table, a column the schema lacks, a shard that is not what its format says, credentials the
    store refused. The message names the path or URL and the fix."""
