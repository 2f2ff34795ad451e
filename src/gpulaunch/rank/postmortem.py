"""The failing frame's local variables, saved when a rank raises: the offline half of
post-mortem debugging (``debugger.py`` is the live half).

``rank<r>.locals.json`` in the attempt directory holds, for the innermost frame of the user's
own code (not a library's, not gpulaunch's), each local's name, type, and a short bounded
repr; tensors and arrays give shape, dtype and device instead of their values (a repr of a CUDA
tensor would copy it to the host, and a large one says nothing in a log). The same summary is
appended to the rank's error, so the caller's exception shows it.
"""

from __future__ import annotations

import json
import os
import reprlib
import sysconfig
import types

from ..common import private

MAX_VARS = 40
MAX_REPR = 160

_LIBRARY_DIRS = tuple({os.path.realpath(p) for p in (
    sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")) if p})
_GPULAUNCH_DIR = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))

_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = MAX_REPR
_repr.maxlevel = 2


def _is_users(filename: str) -> bool:
    path = os.path.realpath(filename)
    return not filename.startswith("<frozen") and not path.startswith(_GPULAUNCH_DIR) \
        and not path.startswith(_LIBRARY_DIRS)


def failing_frame(tb):
    """The innermost traceback entry in the user's code (else the innermost of all)."""
    chosen = last = None
    while tb is not None:
        last = tb
        if _is_users(tb.tb_frame.f_code.co_filename):
            chosen = tb
        tb = tb.tb_next
    return chosen or last


def describe(value) -> dict:
    """Name-free description of one value: type, and shape/dtype/device or a short repr."""
    kind = type(value)
    out = {"type": f"{kind.__module__}.{kind.__qualname__}" if kind.__module__ != "builtins"
           else kind.__qualname__}
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype"):
        try:
            out["shape"] = [int(d) for d in shape]
            out["dtype"] = str(value.dtype)
            if hasattr(value, "device"):
                out["device"] = str(value.device)
            return out
        except (TypeError, ValueError):
            pass
    try:
        text = _repr.repr(value)
    except Exception as e:  # noqa: BLE001 - a broken __repr__ is described, not raised
        text = f"<repr failed: {type(e).__name__}>"
    out["repr"] = text[:MAX_REPR]
    return out


def capture(tb) -> dict | None:
    entry = failing_frame(tb)
    if entry is None:
        return None
    frame = entry.tb_frame
    names = [n for n in frame.f_locals if not (n.startswith("__") and n.endswith("__"))]
    skip = (types.ModuleType, types.FunctionType, type)
    local_vars = []
    for name in names:
        value = frame.f_locals[name]
        if isinstance(value, skip):
            continue
        local_vars.append({"name": name, **describe(value)})
        if len(local_vars) >= MAX_VARS:
            break
    code = frame.f_code
    return {"function": code.co_name, "file": code.co_filename, "line": entry.tb_lineno,
            "locals": local_vars, "more": max(0, len(names) - len(local_vars))}


def summary(data: dict, saved_as: str = "") -> str:
    """The human text of ``capture()``'s record (appended to the rank's error)."""
    where = f"{data['function']} at {data['file']}:{data['line']}"
    head = f"Local variables of the failing frame ({where}"
    head += f"; saved in {saved_as}):" if saved_as else "):"
    lines = [head]
    for v in data["locals"]:
        if "shape" in v:
            detail = f"shape {tuple(v['shape'])} {v['dtype']}" + (
                f" on {v['device']}" if "device" in v else "")
        else:
            detail = f"= {v['repr']}"
        lines.append(f"    {v['name']}: {v['type']} {detail}")
    if not data["locals"]:
        lines.append("    (none)")
    return "\n".join(lines)


def save(exc: BaseException, path) -> str:
    """Capture the failing frame's locals of ``exc`` into ``path``; return the summary ('' when
    nothing could be captured: the report must never fail the rank's error path)."""
    try:
        data = capture(exc.__traceback__)
        if data is None:
            return ""
        tmp = f"{path}.tmp"
        with private.open_file(tmp, "w") as f:       # values of the user's variables: 0600
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
        return summary(data, os.path.basename(str(path)))
    except Exception:  # noqa: BLE001
        return ""
