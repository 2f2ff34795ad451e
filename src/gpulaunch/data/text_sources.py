"""Formats whose files are read whole: JSONL (pyarrow.json), plain text (one row per line) and
WebDataset-style tar shards (one row per sample key, one binary column per file extension).

One block per file; the row count of every file is taken when the source is built (the plan
needs it), by reading each file once.
"""

from __future__ import annotations

import io
import tarfile

from gpulaunch.errors import DataError

from . import _fs
from .sources import Source, _map


class _WholeFileSource(Source):
    suffixes: tuple[str, ...] = ()
    what = "?"

    def __init__(self, url, *, columns=None, storage_options=None):
        super().__init__(url, columns=columns, storage_options=storage_options)
        self.files = _fs.glob_or_list(self.url, self.storage_options, self.suffixes)
        self.block_rows = _map(lambda f: self._count(self._bytes(f), f), self.files)
        if self.columns is not None and self.files:
            first = next((i for i, n in enumerate(self.block_rows) if n), None)
            if first is not None:
                self._check_columns(self._parse(self._bytes(self.files[first]),
                                                self.files[first]).column_names,
                                    self.files[first])

    def _bytes(self, url: str) -> bytes:
        try:
            with _fs.open_binary(url, self.storage_options) as f:
                return f.read()
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001
            raise _fs.explain(url, e) from e

    def read_block(self, i: int):
        url = self.files[i]
        table = self._parse(self._bytes(url), url)
        if table.num_rows != self.block_rows[i]:
            raise DataError(f"{url}: held {self.block_rows[i]} rows when the dataset was opened "
                            f"and {table.num_rows} now; files must not change during a run")
        return table if self.columns is None else table.select(self.columns)

    def _count(self, data: bytes, url: str) -> int:
        raise NotImplementedError

    def _parse(self, data: bytes, url: str):
        raise NotImplementedError


class JsonlSource(_WholeFileSource):
    """Newline-delimited JSON objects; blank lines are skipped."""

    format = "jsonl"
    suffixes = (".jsonl", ".json", ".ndjson")

    def _count(self, data, url):
        return sum(1 for line in data.split(b"\n") if line.strip())

    def _parse(self, data, url):
        import pyarrow.json as pj

        if not data.strip():
            import pyarrow as pa

            return pa.table({})
        try:
            return pj.read_json(io.BytesIO(data))
        except Exception as e:  # noqa: BLE001 - ArrowInvalid names the bad line
            raise DataError(f"{url}: not JSON lines ({e})") from e


class TextSource(_WholeFileSource):
    """UTF-8 text, one row per line (column ``text``), the line ending removed."""

    format = "text"
    suffixes = (".txt", ".text")

    def _lines(self, data: bytes, url: str) -> list[str]:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{url}: not UTF-8 text ({e})") from e
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        return [ln[:-1] if ln.endswith("\r") else ln for ln in lines]

    def _count(self, data, url):
        return len(self._lines(data, url))

    def _parse(self, data, url):
        import pyarrow as pa

        return pa.table({"text": pa.array(self._lines(data, url), pa.string())})


class WebDatasetSource(_WholeFileSource):
    """WebDataset tar shards: files ``<key>.<ext>`` grouped by key into one row each, with
    ``__key__`` and one binary column per extension (a sample without it holds null)."""

    format = "webdataset"
    suffixes = (".tar",)

    def _samples(self, data: bytes, url: str) -> dict[str, dict[str, bytes]]:
        samples: dict[str, dict[str, bytes]] = {}
        try:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
                for m in tar:
                    if not m.isfile():
                        continue
                    base = m.name.rsplit("/", 1)[-1]
                    if base.startswith(".") or "." not in base:
                        continue
                    folder = m.name[:len(m.name) - len(base)]
                    key, ext = base.split(".", 1)
                    samples.setdefault(folder + key, {})[ext] = tar.extractfile(m).read()
        except tarfile.TarError as e:
            raise DataError(f"{url}: not a readable tar shard ({e})") from e
        return samples

    def _count(self, data, url):
        return len(self._samples(data, url))

    def _parse(self, data, url):
        import pyarrow as pa

        samples = self._samples(data, url)
        exts = sorted({e for s in samples.values() for e in s})
        cols = {"__key__": pa.array(list(samples), pa.string())}
        for e in exts:
            cols[e] = pa.array([s.get(e) for s in samples.values()], pa.binary())
        return pa.table(cols)
