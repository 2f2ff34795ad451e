"""Chat rows from tables: ``--data`` a Delta Lake table, or any Parquet/Arrow/JSONL location on
an object store (``s3://bucket/chats``), read through ``gpulaunch.data``.

Local ``.jsonl``/``.parquet`` files keep going through ``datasets.load_dataset`` (``chat_data``);
what this adds is what that cannot read: Delta tables (a pinned version, rows removed by deletion
vectors left out, no Spark) and fsspec URLs. The rows come back as a ``datasets.Dataset`` with a
``messages`` column, since TRL's trainers (and the other frameworks' loaders) take one and shard
it over the ranks themselves. ``GPULAUNCH_DATA_STORAGE_OPTIONS`` (JSON) passes credentials or an
endpoint to fsspec/deltalake; without it the usual ``AWS_*`` environment applies.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def is_table(path: str) -> bool:
    """A Delta table folder, or a URL (``s3://``, ``gs://``, ...): read by ``gpulaunch.data``."""
    path = str(path)
    if "://" in path and not path.startswith("file://"):
        return True
    return (Path(path) / "_delta_log").is_dir()


def read_rows(path: str, columns=("messages",)):
    """Every row of the table at ``path`` (its ``columns``), as a ``datasets.Dataset``."""
    import datasets
    import pyarrow as pa

    from gpulaunch.data import StreamingDataset

    opts = json.loads(os.environ.get("GPULAUNCH_DATA_STORAGE_OPTIONS") or "{}")
    ds = StreamingDataset(path, columns=list(columns), storage_options=opts, shuffle=False)
    source = ds.source
    table = pa.concat_tables([source.read_block(i) for i in range(len(source.block_rows))],
                             promote_options="default")
    return datasets.Dataset(table)
