"""A batch's rows (a ``pyarrow.Table``) as tensors, without a per-row Python loop.

Numbers and booleans become 1-D tensors, lists of numbers of one length 2-D tensors (token ids of
a packed sequence, an embedding), both from Arrow's buffers through NumPy; anything else (strings,
bytes, ragged lists, structs) a Python list.
"""

from __future__ import annotations

import numpy as np
import torch


def column_to_torch(col):
    import pyarrow as pa
    import pyarrow.types as t

    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    typ = col.type
    if col.null_count == 0 and (t.is_integer(typ) or t.is_floating(typ) or t.is_boolean(typ)):
        arr = col.to_numpy(zero_copy_only=False)
        if arr.dtype == np.uint16 or arr.dtype == np.uint32:
            arr = arr.astype(np.int64)
        return torch.from_numpy(_writable(arr))
    if (t.is_list(typ) or t.is_large_list(typ) or t.is_fixed_size_list(typ)) and \
            col.null_count == 0 and len(col) and _numeric(typ.value_type):
        if t.is_fixed_size_list(typ):
            width = typ.list_size
        else:
            lengths = np.diff(col.offsets.to_numpy())
            width = int(lengths[0]) if (lengths == lengths[0]).all() else None
        if width is not None:
            flat = col.flatten()
            if flat.null_count == 0:
                arr = flat.to_numpy(zero_copy_only=False)
                return torch.from_numpy(_writable(arr)).view(len(col), width)
    return col.to_pylist()


def _writable(arr: np.ndarray) -> np.ndarray:
    # Arrow buffers are read-only; a tensor over one would be writable in name only
    return arr if arr.flags.writeable and arr.flags.c_contiguous else np.array(arr, copy=True)


def _numeric(typ) -> bool:
    import pyarrow.types as t

    return t.is_integer(typ) or t.is_floating(typ) or t.is_boolean(typ)


def to_torch(table) -> dict:
    """``{column name: tensor or list}`` for a ``pyarrow.Table``."""
    return {name: column_to_torch(table.column(name)) for name in table.column_names}
