"""``gpulaunch.data``: streaming, row-sharded, exactly resumable datasets for distributed training.

    from gpulaunch.data import StreamingDataset, StreamingLoader

    ds = StreamingDataset("s3://bucket/events", format="delta", columns=["x", "y"], seed=0)
    loader = StreamingLoader(ds, batch_size=256, num_workers=4, device="auto")
    for epoch in loader.epochs(3):
        for batch in loader:            # {"x": tensor, "y": tensor}, this rank's rows only
            ...

Formats: Parquet, Delta Lake (a pinned version, deletion vectors honoured), JSONL, text,
WebDataset tar shards, Hugging Face ``datasets`` Arrow files; any fsspec URL. Rows (not files) are
split over ranks x loader workers with a per-epoch seeded shuffle, every rank gets the same
number of batches, and the loader's position rides in every ``save_checkpoint`` so a restart, at
the same or another world size, sees each row of the epoch exactly once (docs/data.md).

Map-style datasets keep ``distributed_loader``; whole files per stream, ``ShardedFileDataset``.
"""

from .dataset import FORMATS, StreamingDataset, detect_format
from .files import ShardedFileDataset, read_lines
from .loader import StreamingLoader
from .mapstyle import DistributedLoader, distributed_loader, seed_everything, to_device
from .state import Checkpointable, register, unregister

__all__ = ["FORMATS", "Checkpointable", "DistributedLoader", "ShardedFileDataset",
           "StreamingDataset", "StreamingLoader", "detect_format", "distributed_loader",
           "read_lines", "register", "seed_everything", "to_device", "unregister"]
