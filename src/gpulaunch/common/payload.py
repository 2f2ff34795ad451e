"""Ship the function and its arguments to the ranks, and results/errors back.

Everything travels by value with cloudpickle, so functions, lambdas, closures and classes
defined in ``__main__``, a REPL or a notebook cell work under a fresh interpreter (spawn). A
function that lives in a local, uninstalled module (``train.py`` next to the notebook) is
pickled by value too, so the ranks do not need to import that module.

Each argument is pickled on its own first, so a failure or an oversized argument is reported
by name before any process starts.
"""

from __future__ import annotations

import collections
import importlib
import io
import linecache
import os
import sys
import sysconfig
import threading
import traceback
import types
from pathlib import Path

import cloudpickle

from ..errors import SerializationError
from .records import RankError

DEFAULT_MAX_ARG_BYTES = 1 << 30   # 1 GiB: past this, load the data inside the function


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _installed_roots() -> list[str]:
    roots = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            roots.add(os.path.realpath(p))
    for p in sys.path:
        if p and ("site-packages" in p or "dist-packages" in p):
            roots.add(os.path.realpath(p))
    return sorted(roots)


def _is_local_module(module: types.ModuleType | None) -> bool:
    """A module imported from the user's own files rather than from an installed package."""
    if module is None or module.__name__ == "__main__":
        return False
    path = getattr(module, "__file__", None)
    if not path:
        return False
    real = os.path.realpath(path)
    return not any(real.startswith(root + os.sep) for root in _installed_roots())


def _code_reduce_keeping_filename(code: types.CodeType):
    """cloudpickle >= 3.1 renames every shipped code object's file to "<dynamic-code>" (for
    deterministic pickles). We want the ranks' tracebacks to name the real file and line, so
    the original name is put back."""
    ctor, args = cloudpickle.cloudpickle._code_reduce(code)
    args = tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)
    return ctor, args


class _Pickler(cloudpickle.Pickler):
    dispatch_table = collections.ChainMap({types.CodeType: _code_reduce_keeping_filename},
                                          cloudpickle.Pickler.dispatch_table)

    def reducer_override(self, obj):
        # Module *subclasses* that replace themselves in sys.modules (torch.backends.cudnn is a
        # CudnnModule, torch.backends.cuda a CudaModule...) miss cloudpickle's exact-type table
        # ("cannot pickle 'CudnnModule' object" for any function that touches them): send them
        # by name, as cloudpickle sends plain importable modules.
        if isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType \
                and sys.modules.get(obj.__name__) is obj:
            return importlib.import_module, (obj.__name__,)
        return super().reducer_override(obj)


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=5).dump(obj)
    return buf.getvalue()


def rebuild_exception(cls, args, state):
    """An exception from its args and attributes, without calling its ``__init__``."""
    exc = cls.__new__(cls, *args)
    exc.args = args
    if state:
        exc.__dict__.update(state)
    return exc


class _ExceptionByState(_Pickler):
    """Pickles exceptions by state: ``BaseException.__reduce__`` re-calls ``cls(*self.args)``,
    which fails for ``MyErr(code, msg)`` whose ``__init__`` passes only ``msg`` to ``super()``
    (TypeError: missing 'msg'); the caller would get a RemoteError instead of the exception."""

    def reducer_override(self, obj):
        if isinstance(obj, BaseException) and type(obj).__reduce__ is BaseException.__reduce__:
            return rebuild_exception, (type(obj), obj.args, dict(getattr(obj, "__dict__", {})))
        return super().reducer_override(obj)


def _dumps_exception(exc: BaseException) -> bytes:
    """The exception pickled so the caller can rebuild it: as Python pickles it when that
    round-trips, else by state (``_ExceptionByState``)."""
    blob = _dumps(exc)
    try:
        cloudpickle.loads(blob)
        return blob
    except Exception:  # noqa: BLE001 - a constructor that cannot take its own args
        buf = io.BytesIO()
        _ExceptionByState(buf, protocol=5).dump(exc)
        return buf.getvalue()


def _source_lines(func) -> dict[str, list[str]]:
    """Source of code that lives only in the caller's memory (a notebook cell, ``python -c``),
    so tracebacks in the ranks can show the lines."""
    code = getattr(func, "__code__", None)
    if code is None or os.path.exists(code.co_filename):
        return {}
    lines = linecache.getlines(code.co_filename)
    return {code.co_filename: lines} if lines else {}


# cloudpickle's by-value registry is process-wide. Two launches serializing functions of the same
# local module at once (threads in one notebook) must not unregister it under each other: the
# second unregister raised "not registered for pickle by value", or a launch still pickling lost
# by-value pickling halfway. So registrations are counted, and one the user made stays theirs.
_BY_VALUE_LOCK = threading.Lock()
_BY_VALUE_USERS: dict[str, int] = {}


def _hold_by_value(module: types.ModuleType) -> bool:
    """Make ``module`` pickle by value for one serialization; True if it must be released after."""
    with _BY_VALUE_LOCK:
        users = _BY_VALUE_USERS.get(module.__name__, 0)
        if users == 0:
            if module.__name__ in cloudpickle.list_registry_pickle_by_value():
                return False          # the user registered it: not ours to undo
            cloudpickle.register_pickle_by_value(module)
        _BY_VALUE_USERS[module.__name__] = users + 1
        return True


def _release_by_value(module: types.ModuleType) -> None:
    with _BY_VALUE_LOCK:
        users = _BY_VALUE_USERS.pop(module.__name__) - 1
        if users:
            _BY_VALUE_USERS[module.__name__] = users
        else:
            cloudpickle.unregister_pickle_by_value(module)


def serialize_call(func, args: tuple, kwargs: dict, *, arg_names: dict[int, str] | None = None,
                   max_arg_bytes: int = DEFAULT_MAX_ARG_BYTES) -> bytes:
    """Pickle ``func(*args, **kwargs)`` into one blob, naming the culprit on any failure."""
    module = sys.modules.get(getattr(func, "__module__", None) or "")
    by_value = _is_local_module(module) and _hold_by_value(module)
    try:
        try:
            fn_blob = _dumps(func)
        except Exception as e:
            raise SerializationError(
                f"The function {getattr(func, '__qualname__', func)!r} cannot be pickled: {e}. "
                "It probably captures a non-picklable object (an open file, a lock, a database "
                "connection, a CUDA context) in a closure or global: create that object inside "
                "the function instead.") from e
        if len(fn_blob) > max_arg_bytes:
            raise SerializationError(
                f"The function {func.__qualname__!r} pickles to {_human(len(fn_blob))} (limit "
                f"{_human(max_arg_bytes)}): it captures large objects (a dataset or tensor in a "
                "global or closure). Load the data inside the function instead.")
        arg_blobs = []
        items = [(arg_names.get(i, f"positional argument {i}") if arg_names else
                  f"positional argument {i}", a) for i, a in enumerate(args)]
        items += [(f"argument {k!r}", v) for k, v in kwargs.items()]
        for label, value in items:
            try:
                blob = _dumps(value)
            except Exception as e:
                raise SerializationError(
                    f"{label[0].upper() + label[1:]} (a {type(value).__name__}) cannot be "
                    f"pickled: {e}. Pass something picklable (a path, a config) and build the "
                    "object inside the function.") from e
            if len(blob) > max_arg_bytes:
                raise SerializationError(
                    f"{label[0].upper() + label[1:]} pickles to {_human(len(blob))}, above the "
                    f"{_human(max_arg_bytes)} limit. Every rank would load a copy: load the data "
                    "inside the function (from a file path or URL) instead of passing it.")
            arg_blobs.append(blob)
        envelope = {
            "func": fn_blob,
            "args": arg_blobs[:len(args)],
            "kwargs": dict(zip(kwargs.keys(), arg_blobs[len(args):])),
            "sys_path": [p for p in sys.path if p],
            "sources": _source_lines(func),
            "python": sys.version_info[:3],
        }
        return _dumps(envelope)
    finally:
        if by_value:
            _release_by_value(module)


def load_call(path: Path):
    """In a rank: return (func, args, kwargs) from the payload file."""
    import pickle
    with open(path, "rb") as f:
        envelope = pickle.load(f)
    if tuple(envelope["python"][:2]) != sys.version_info[:2]:
        raise RuntimeError(f"The payload was written by Python {envelope['python']} but this rank "
                           f"runs Python {sys.version_info[:3]}; use the same interpreter.")
    for filename, lines in envelope.get("sources", {}).items():
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
    for p in envelope["sys_path"]:
        if p not in sys.path:
            sys.path.append(p)
    func = pickle.loads(envelope["func"])
    args = tuple(pickle.loads(b) for b in envelope["args"])
    kwargs = {k: pickle.loads(b) for k, b in envelope["kwargs"].items()}
    return func, args, kwargs


# ----------------------------------------------------------------------- errors as data
def exception_record(exc: BaseException, *, rank: int, host: str, tb: str | None = None,
                     extra: str = "", **fields) -> RankError:
    """What a rank writes when its function raised: enough to rebuild or describe the error.
    An exception whose ``__str__`` raises is still reported, by its type."""
    if tb is None:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        blob = _dumps_exception(exc)
        cloudpickle.loads(blob)  # make sure the caller will be able to rebuild it
    except Exception:
        blob = None
    try:
        message = str(exc)
    except Exception as e:  # noqa: BLE001
        message = f"<str() of the exception failed: {type(e).__name__}>"
    return RankError(type=f"{type(exc).__module__}.{type(exc).__qualname__}", message=message,
                     traceback=tb + (f"\n{extra}" if extra else ""), rank=rank, host=host,
                     exception=blob, **fields)
