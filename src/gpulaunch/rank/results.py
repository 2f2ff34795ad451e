"""A rank's return value, written for the caller: every tensor on the CPU, streamed to disk.

* Device tensors (CUDA, or any non-CPU device) anywhere in the value — nested in dicts, lists,
  tuples, dataclasses, namedtuples, objects' attributes — are pickled as CPU copies, so the
  caller never needs CUDA (a notebook that unpickled a CUDA tensor would create a CUDA context
  and keep ~500 MiB of GPU memory for the rest of its life). Containers keep their types.
* A non-leaf tensor that requires grad (``loss`` itself) is sent detached: torch refuses to
  pickle it, and its graph could not travel anyway.
* The pickle goes straight into the file (then an atomic rename): no second in-memory copy of
  a large result at the very end of a long run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import cloudpickle


def _rebuild(tensor):
    """Unpickling side of a converted tensor: it already is the CPU copy."""
    return tensor


class _ResultPickler(cloudpickle.Pickler):
    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            moved = obj
            if obj.device.type not in ("cpu", "meta"):
                moved = obj.detach().to("cpu")
            elif obj.requires_grad and obj.grad_fn is not None:
                moved = obj.detach()
            if moved is not obj:
                return _rebuild, (moved,)
        return super().reducer_override(obj)


def write(path: Path, value) -> None:
    """Pickle ``value`` (tensors moved to the CPU) into ``path`` atomically."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            _ResultPickler(f, protocol=5).dump(value)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def dumps(value) -> bytes:
    """The same pickle in memory (small values, tests)."""
    import io
    buf = io.BytesIO()
    _ResultPickler(buf, protocol=5).dump(value)
    return buf.getvalue()


def unpicklable_error(rank: int, result, cause: Exception):
    """The rank's failure when its return value cannot be pickled: what it was, and the fix."""
    from ..errors import SerializationError
    return SerializationError(
        f"Rank {rank} returned a {type(result).__module__}.{type(result).__qualname__} that "
        f"cannot be pickled ({cause}). Return plain data (numbers, dicts, lists, tensors, "
        "state_dicts) instead.")
