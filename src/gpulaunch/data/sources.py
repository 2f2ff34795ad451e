"""Where rows come from: one :class:`Source` per open format, each read by its field's library.

A source knows, before any worker starts, its *blocks* (runs of rows it can read alone: a Parquet
row group, an Arrow file's chunk, a JSONL file) and how many rows each holds; ``read_block(i)``
returns block ``i`` as a ``pyarrow.Table``. The sharding plan only ever sees those row counts.

Formats here: Parquet (pyarrow), Delta Lake (the ``deltalake`` package: the table version is
pinned when the source is built, deletion vectors are honoured), Hugging Face ``datasets`` Arrow
files. JSONL, text and WebDataset tar shards are in :mod:`.text_sources`.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from gpulaunch.errors import DataError

from . import _fs


class Source:
    """Base: ``url``, ``block_rows`` (rows per block), ``columns`` and ``read_block(i)``."""

    format = "?"

    def __init__(self, url: str, *, columns=None, storage_options: dict | None = None):
        self.url = str(url)
        self.columns = list(columns) if columns is not None else None
        self.storage_options = dict(storage_options or {})
        self.block_rows: list[int] = []
        self._local = threading.local()

    @property
    def num_rows(self) -> int:
        return sum(self.block_rows)

    def read_block(self, i: int):
        raise NotImplementedError

    def _check_columns(self, names, where: str) -> None:
        if self.columns is None:
            return
        missing = [c for c in self.columns if c not in names]
        if missing:
            raise DataError(f"{where}: no column {missing[0]!r}"
                            f"{' (nor ' + repr(missing[1:]) + ')' if missing[1:] else ''}; "
                            f"its columns are {list(names)}; pass columns= from those")

    def _cache(self) -> dict:
        # open file handles, per thread of the process that reads (workers fork or spawn)
        if not hasattr(self._local, "d") or getattr(self._local, "pid", None) != os.getpid():
            self._local.d, self._local.pid = {}, os.getpid()
        return self._local.d

    def __getstate__(self):
        st = dict(self.__dict__)
        st.pop("_local", None)
        return st

    def __setstate__(self, st):
        self.__dict__.update(st)
        self._local = threading.local()


def _map(fn, items, threads: int = 16):
    items = list(items)
    if len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(min(threads, len(items))) as pool:
        return list(pool.map(fn, items))


# --------------------------------------------------------------------------- Parquet
class ParquetSource(Source):
    """Parquet files (a file, a folder, a glob); one block per row group."""

    format = "parquet"

    def __init__(self, url, *, columns=None, storage_options=None, files=None, masks=None,
                 constants=None):
        super().__init__(url, columns=columns, storage_options=storage_options)
        self.files = list(files) if files is not None else \
            _fs.glob_or_list(self.url, self.storage_options, (".parquet", ".pq"))
        self.masks = masks or {}            # file -> selection vector (Delta deletion vectors)
        self.constants = constants or {}    # file -> {column: value} (Delta partition values)
        metas = _map(self._footer, self.files)
        self._check_columns(self._names(metas[0]), self.files[0])
        self.blocks: list[tuple[int, int, int, int]] = []   # (file, row group, first row, rows)
        for f, (meta, _) in enumerate(metas):
            first = 0
            mask = self.masks.get(self.files[f])
            for g in range(meta.num_row_groups):
                rows = meta.row_group(g).num_rows
                live = rows if mask is None else int(_mask_slice(mask, first, rows).sum())
                if live:
                    self.blocks.append((f, g, first, rows))
                    self.block_rows.append(live)
                first += rows

    def _names(self, meta_schema) -> list[str]:
        names = list(meta_schema[1].names)
        return names + [c for c in self.constants.get(self.files[0], {}) if c not in names]

    def _footer(self, url: str):
        pf = self._file(url)
        return pf.metadata, pf.schema_arrow

    def _file(self, url: str):
        import pyarrow.parquet as pq

        cache = self._cache()
        if url not in cache:
            try:
                cache[url] = pq.ParquetFile(_fs.open_binary(url, self.storage_options))
            except DataError:
                raise
            except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid and OSError
                raise _fs.explain(url, e, "read as Parquet") from e
        return cache[url]

    def read_block(self, i: int):
        import pyarrow as pa

        f, g, first, rows = self.blocks[i]
        url = self.files[f]
        consts = self.constants.get(url, {})
        cols = None if self.columns is None else [c for c in self.columns if c not in consts]
        try:
            table = self._file(url).read_row_group(g, columns=cols)
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001
            raise _fs.explain(url, e, f"read row group {g} as Parquet") from e
        mask = self.masks.get(url)
        if mask is not None:
            table = table.filter(pa.array(_mask_slice(mask, first, rows)))
        for name, value in consts.items():
            if self.columns is None or name in self.columns:
                table = table.append_column(name, pa.array([value] * table.num_rows))
        return table


def _mask_slice(mask, first: int, rows: int):
    """Selection vector entries first..first+rows-1; rows past its end are live (Delta's rule)."""
    import numpy as np

    part = np.asarray(mask[first:first + rows], dtype=bool)
    if len(part) < rows:
        part = np.concatenate([part, np.ones(rows - len(part), dtype=bool)])
    return part


# --------------------------------------------------------------------------- Delta Lake
def delta_storage_options(fsspec_options: dict) -> dict:
    """deltalake's (object_store's) spelling of s3fs-style ``storage_options``."""
    o = dict(fsspec_options or {})
    out = {k: str(v) for k, v in o.items() if k.isupper()}      # already object_store keys
    if "key" in o:
        out["AWS_ACCESS_KEY_ID"] = o["key"]
    if "secret" in o:
        out["AWS_SECRET_ACCESS_KEY"] = o["secret"]
    if "token" in o:
        out["AWS_SESSION_TOKEN"] = o["token"]
    endpoint = o.get("endpoint_url") or (o.get("client_kwargs") or {}).get("endpoint_url")
    if endpoint:
        out["AWS_ENDPOINT_URL"] = endpoint
        if endpoint.startswith("http://"):
            out["AWS_ALLOW_HTTP"] = "true"
    region = (o.get("client_kwargs") or {}).get("region_name")
    if region:
        out["AWS_REGION"] = region
    return out


class DeltaSource(ParquetSource):
    """A Delta Lake table at one version (the newest when the source is built, or ``version``),
    read without Spark: its live data files through Parquet, minus rows deleted by deletion
    vectors, with partition columns added back."""

    format = "delta"

    def __init__(self, url, *, columns=None, storage_options=None, version=None):
        try:
            from deltalake import DeltaTable
        except ImportError as e:
            raise DataError(f"{url}: reading Delta tables needs the deltalake package "
                            "(pip install 'gpulaunch[data]')") from e
        import pyarrow as pa

        url = str(url).rstrip("/")
        try:
            dt = DeltaTable(url, version=version,
                            storage_options=delta_storage_options(storage_options or {}))
        except Exception as e:  # noqa: BLE001 - deltalake raises TableNotFoundError, OSError...
            text = str(e).lower()
            if "not a delta table" in text or "no files in log segment" in text \
                    or "tablenotfound" in type(e).__name__.lower():
                raise DataError(f"{url}: not a Delta table (no _delta_log found: {e}); check "
                                "the path, or read Parquet files with format='parquet'") from e
            raise _fs.explain(url, e, "open as a Delta table") from e
        self.version = dt.version()
        files = [_norm(u, url) for u in dt.file_uris()]
        masks = {}
        dv = pa.table(dt.deletion_vectors().read_all())
        for path, sel in zip(dv.column("filepath").to_pylist(), dv.column("selection_vector").to_pylist()):
            masks[_norm(path, url)] = sel
        constants = {}
        actions = pa.table(dt.get_add_actions(flatten=True))
        parts = [c for c in actions.column_names if c.startswith("partition.")]
        if parts:
            rows = actions.select(["path", *parts]).to_pylist()
            for r in rows:
                full = _norm(r["path"] if _fs.is_url(r["path"]) or r["path"].startswith("/")
                             else f"{url}/{r['path']}", url)
                constants[full] = {k[len("partition."):]: v for k, v in r.items() if k != "path"}
        self.schema_names = [f.name for f in pa.schema(dt.schema())]
        if not files:
            raise DataError(f"{url}: the Delta table has no data files at version {self.version}")
        super().__init__(url, columns=columns, storage_options=storage_options, files=files,
                         masks=masks, constants=constants)


def _norm(path: str, table_url: str) -> str:
    path = str(path)
    if path.startswith("file://"):
        path = path[len("file://"):]
        if path.startswith("//"):           # file:///abs -> /abs
            path = path[1:]
    return path


# --------------------------------------------------------------------------- HF datasets Arrow
class ArrowSource(Source):
    """Arrow IPC files as Hugging Face ``datasets`` writes them (``save_to_disk`` folders,
    cache files); blocks of ``block_rows`` rows. Local files are memory-mapped."""

    format = "arrow"

    def __init__(self, url, *, columns=None, storage_options=None, block_rows: int = 8192):
        super().__init__(url, columns=columns, storage_options=storage_options)
        self.files = _fs.glob_or_list(self.url, self.storage_options, (".arrow",))
        lens = _map(lambda f: self._table(f).num_rows, self.files)
        self._check_columns(self._table(self.files[0]).column_names, self.files[0])
        self.blocks: list[tuple[int, int, int]] = []
        for f, n in enumerate(lens):
            for start in range(0, n, block_rows):
                self.blocks.append((f, start, min(block_rows, n - start)))
                self.block_rows.append(min(block_rows, n - start))

    def _table(self, url: str):
        import pyarrow as pa

        cache = self._cache()
        if url not in cache:
            try:
                if _fs.is_url(url) and not url.startswith("file://"):
                    with _fs.open_binary(url, self.storage_options) as f:
                        data = pa.py_buffer(f.read())
                    source = pa.BufferReader(data)
                else:
                    source = pa.memory_map(_fs.local_path(url))
                try:
                    table = pa.ipc.open_stream(source).read_all()
                except pa.ArrowInvalid:                  # the random-access file format
                    source.seek(0)
                    table = pa.ipc.open_file(source).read_all()
            except DataError:
                raise
            except Exception as e:  # noqa: BLE001
                raise _fs.explain(url, e, "read as Arrow IPC") from e
            cache[url] = table if self.columns is None or not hasattr(self, "blocks") \
                else table.select(self.columns)
        return cache[url]

    def read_block(self, i: int):
        f, start, rows = self.blocks[i]
        table = self._table(self.files[f]).slice(start, rows)
        return table if self.columns is None else table.select(self.columns)
