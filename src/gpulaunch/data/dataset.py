"""``StreamingDataset``: rows of a Parquet/Delta/JSONL/text/WebDataset/Arrow source, read in the
order the sharding plan gives, as batches (dicts of tensors) ready for a model.

The dataset is what a loader worker runs: it reads the blocks its batches need (in a few reader
threads, a few batches ahead of the one being built), keeps the current shuffle window's blocks
in memory, and turns each batch's rows into tensors. :class:`~gpulaunch.data.StreamingLoader`
decides which batches a worker builds (:mod:`.plan`); iterating the dataset by itself yields
this rank's rows of a whole epoch, one dict per row.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from gpulaunch.errors import DataError

from . import _fs
from .collate import to_torch
from .plan import Assignment, EpochOrder
from .sources import ArrowSource, DeltaSource, ParquetSource, Source
from .text_sources import JsonlSource, TextSource, WebDatasetSource

FORMATS = {"parquet": ParquetSource, "delta": DeltaSource, "arrow": ArrowSource,
           "jsonl": JsonlSource, "text": TextSource, "webdataset": WebDatasetSource}


def detect_format(url: str, storage_options: dict | None = None) -> str:
    """The format a path's name or contents say: a ``_delta_log`` folder, a suffix, a folder
    of such files (Hugging Face ``save_to_disk`` folders hold ``.arrow`` files)."""
    low = url.lower().rstrip("/")
    for fmt, sfx in (("parquet", (".parquet", ".pq")), ("arrow", (".arrow",)),
                     ("jsonl", (".jsonl", ".ndjson", ".json")), ("text", (".txt", ".text")),
                     ("webdataset", (".tar",))):
        if low.endswith(sfx):
            return fmt
    fs, path = _fs.url_to_fs(url, storage_options)
    try:
        if fs.exists(path.rstrip("/") + "/_delta_log"):
            return "delta"
        if not fs.exists(path):
            raise FileNotFoundError(path)
        names = [p for p in fs.find(path) if "/." not in p]
    except Exception as e:  # noqa: BLE001
        raise _fs.explain(url, e, "list") from e
    for fmt, sfx in (("parquet", (".parquet", ".pq")), ("arrow", (".arrow",)),
                     ("jsonl", (".jsonl", ".ndjson")), ("webdataset", (".tar",)),
                     ("text", (".txt",))):
        if any(n.lower().endswith(sfx) for n in names):
            return fmt
    raise DataError(f"{url}: cannot tell its format (no _delta_log, no .parquet/.arrow/.jsonl/"
                    f".txt/.tar files); pass format= one of {sorted(FORMATS)}")


@dataclass
class _Job:
    """What one pass of one rank reads: set by the loader, shipped to its workers."""
    epoch: int
    assignment: Assignment
    rank: int
    skip: int = 0             # batches of the assignment already handed out before a restart


class StreamingDataset(IterableDataset):
    """Rows of ``url`` (a local path, a glob, or any fsspec URL: ``s3://``, ``gs://``, ...).

    Args:
        url: a Delta table folder, a Parquet/Arrow/JSONL/text/tar file, folder or glob.
        format: ``"auto"`` (from the path), or one of ``parquet``, ``delta``, ``arrow``,
            ``jsonl``, ``text``, ``webdataset``.
        columns: read only these columns (an error names the ones the schema has).
        storage_options: passed to fsspec (``{"key", "secret", "endpoint_url"}`` for S3);
            for Delta also translated to deltalake's ``AWS_*`` options.
        version: Delta only: the table version to read; default the newest at construction,
            pinned from then on (``dataset.version``) so a restart reads the same rows.
        shuffle, seed: per-epoch shuffle of block order and of rows inside each window of
            ``shuffle_rows`` rows; the same on every rank for the same (seed, epoch).
        transform: ``fn(row dict) -> sample``, applied per row; batches are then made by
            torch's ``default_collate``. Without it a batch is the columns as tensors
            (numbers, fixed-length number lists) or lists (strings, bytes, others).
        collate: ``fn(pyarrow.Table) -> batch``, replacing both of the above.
        block_rows: Arrow files only: rows per block.
        read_threads: threads per loader worker that read blocks ahead.
    """

    def __init__(self, url, *, format: str = "auto", columns=None, storage_options=None,
                 version: int | None = None, shuffle: bool = True, seed: int = 0,
                 shuffle_rows: int = 65536, transform=None, collate=None,
                 block_rows: int = 8192, read_threads: int = 4):
        if isinstance(url, Source):
            self.source = url
        else:
            url = str(url)
            fmt = detect_format(url, storage_options) if format == "auto" else format
            if fmt not in FORMATS:
                raise DataError(f"{url}: unknown format {fmt!r}; pick one of {sorted(FORMATS)}")
            kw = {"columns": columns, "storage_options": storage_options}
            if fmt == "delta":
                kw["version"] = version
            elif version is not None:
                raise DataError(f"{url}: version= is for Delta tables; this is {fmt}")
            if fmt == "arrow":
                kw["block_rows"] = block_rows
            self.source = FORMATS[fmt](url, **kw)
        if self.source.num_rows == 0:
            raise DataError(f"{self.source.url}: no rows to read")
        self.shuffle, self.seed, self.shuffle_rows = bool(shuffle), int(seed), int(shuffle_rows)
        self.transform, self.collate, self.read_threads = transform, collate, int(read_threads)
        self._job: _Job | None = None

    @property
    def num_rows(self) -> int:
        return self.source.num_rows

    @property
    def version(self) -> int | None:
        return getattr(self.source, "version", None)

    def __len__(self) -> int:
        return self.num_rows

    def order(self, epoch: int) -> EpochOrder:
        return EpochOrder(self.source.block_rows, seed=self.seed, epoch=epoch,
                          shuffle=self.shuffle, shuffle_rows=self.shuffle_rows)

    def with_job(self, epoch: int, assignment: Assignment, rank: int,
                 skip: int = 0) -> StreamingDataset:
        """A shallow copy that reads ``rank``'s batches of ``assignment`` after the first
        ``skip`` (what workers get)."""
        ds = copy.copy(self)
        ds._job = _Job(epoch, assignment, rank, skip)
        return ds

    # ------------------------------------------------------------------ reading
    def __iter__(self):
        job = self._job
        if job is None:            # used alone: this rank's rows, one at a time
            from gpulaunch import runtime as rt

            n = self.num_rows
            a = Assignment([(0, n)], rt.get_world_size(), 1, 1)
            job = _Job(0, a, rt.get_global_rank())
            info = get_worker_info()
            for batch in self._batches(job, info.id if info else None, collate_rows=True):
                yield batch
            return
        info = get_worker_info()
        worker = info.id if info is not None else None
        if info is not None and info.num_workers != job.assignment.num_workers:
            raise DataError(f"the plan was made for {job.assignment.num_workers} loader workers "
                            f"but the DataLoader runs {info.num_workers}")
        yield from self._batches(job, worker)

    def _batches(self, job: _Job, worker: int | None, collate_rows: bool = False):
        order = self.order(job.epoch)
        batches = list(job.assignment.batches(job.rank, worker, job.skip))
        reader = _BlockReader(self.source, keep=2 * order.max_window_blocks + 4,
                              threads=self.read_threads)
        try:
            where = [_rows_at(order, b.positions) for b in batches]
            ahead = 4
            for i in range(min(ahead, len(where))):
                reader.prefetch(np.unique(where[i][0]))
            for i, b in enumerate(batches):
                if i + ahead < len(where):
                    reader.prefetch(np.unique(where[i + ahead][0]))
                table = reader.take(*where[i])
                if collate_rows:
                    yield from (self._sample(r) for r in table.to_pylist())
                else:
                    yield self.collate_table(table)
        finally:
            reader.close()

    def _sample(self, row: dict):
        return self.transform(row) if self.transform is not None else row

    def collate_table(self, table):
        """A batch of the rows of ``table`` (a ``pyarrow.Table``): ``collate``, else
        ``transform`` per row and torch's ``default_collate``, else the columns as tensors."""
        if self.collate is not None:
            return self.collate(table)
        if self.transform is not None:
            from torch.utils.data import default_collate

            return default_collate([self.transform(r) for r in table.to_pylist()])
        return to_torch(table)


def _rows_at(order: EpochOrder, positions: np.ndarray):
    """(block ids, rows in block) of ``positions`` (contiguous runs looked up together)."""
    if len(positions) == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    cut = np.flatnonzero(np.diff(positions) != 1) + 1
    bounds = np.concatenate([[0], cut, [len(positions)]])
    parts = [order.rows(int(positions[a]), int(positions[b - 1]) + 1)
             for a, b in zip(bounds[:-1], bounds[1:])]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


class _BlockReader:
    """Blocks by id, read in background threads, the most recent ``keep`` kept in memory."""

    def __init__(self, source: Source, keep: int, threads: int):
        self.source, self.keep = source, max(2, keep)
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="gpulaunch-data")
        self.blocks: OrderedDict[int, object] = OrderedDict()

    def prefetch(self, ids) -> dict:
        """Start reading blocks ``ids`` (those not held); return their futures."""
        futures = {}
        for b in ids:
            b = int(b)
            if b in self.blocks:
                self.blocks.move_to_end(b)
            else:
                self.blocks[b] = self.pool.submit(self.source.read_block, b)
            futures[b] = self.blocks[b]
        while len(self.blocks) > self.keep:
            self.blocks.popitem(last=False)
        return futures

    def take(self, block_ids: np.ndarray, rows: np.ndarray):
        import pyarrow as pa

        ids = np.unique(block_ids)
        futures = self.prefetch(ids)
        if len(ids) == 1:
            return futures[int(ids[0])].result().take(pa.array(rows))
        parts, index = [], np.empty(len(rows), np.int64)
        done = 0
        for b in ids:
            sel = np.flatnonzero(block_ids == b)
            parts.append(futures[int(b)].result().take(pa.array(rows[sel])))
            index[sel] = np.arange(done, done + len(sel))
            done += len(sel)
        table = pa.concat_tables(parts, promote_options="default")
        return table.take(pa.array(index))

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.blocks.clear()


__all__ = ["FORMATS", "StreamingDataset", "detect_format"]
