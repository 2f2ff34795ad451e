"""Where a ``bench/gpu_throughput.py`` row gets its batches (``--data-source``):

    memory    the token batches in host memory, through ``distributed_loader(device=...)``
    parquet   the same batches written once to a Parquet file (one row per sequence: ``x`` and
              ``y`` as int32 lists of ``seq`` tokens, row groups of 4 batches), read back through
              ``gpulaunch.data.StreamingLoader`` (2 loader workers, pinned memory, the next
              batch's copy to the GPU issued ahead): the data path a real run takes

Either way the row's ``data wait ms`` is the time ``next(loader)`` took inside the timed step.
"""

from __future__ import annotations

import os
import tempfile

SOURCES = ("memory", "parquet")


def loader(source: str, token_batches, bs: int, device, workers: int = 2):
    """An iterator of ``(x, y)`` on ``device`` and whether its host memory is pinned."""
    import torch

    if source == "memory":
        from gpulaunch.parallel import distributed_loader

        rows = [(x[i], y[i]) for x, y in token_batches for i in range(bs)]
        ld = distributed_loader(rows, batch_size=bs, shuffle=False, device=device)
        return iter(ld), ld.pin_memory
    if source != "parquet":
        raise SystemExit(f"--data-source {source!r}: pick one of {', '.join(SOURCES)}")
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gpulaunch.data import StreamingDataset, StreamingLoader

    folder = tempfile.mkdtemp(prefix="gpulaunch-bench-data-")
    x = torch.cat([b[0] for b in token_batches]).to(torch.int32).numpy()
    y = torch.cat([b[1] for b in token_batches]).to(torch.int32).numpy()
    seq = x.shape[1]

    def col(a):
        return pa.FixedSizeListArray.from_arrays(pa.array(a.reshape(-1)), seq)
    pq.write_table(pa.table({"x": col(x), "y": col(y)}), os.path.join(folder, "tokens.parquet"),
                   row_group_size=4 * bs)
    ds = StreamingDataset(folder, shuffle=False)
    ld = StreamingLoader(ds, bs, num_workers=workers, device=device, rank=0, world_size=1,
                         name=None)

    def batches():
        for b in ld:
            yield b["x"].long(), b["y"].long()
    return batches(), ld.pin_memory
