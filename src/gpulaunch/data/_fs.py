"""Paths and URLs through fsspec, and the errors that name them.

Every read of the data layer goes through here, so that a missing file, a refused credential or
a file that is not what its format says turns into one :class:`~gpulaunch.errors.DataError`
naming the URL and the fix, on whichever rank or loader worker met it.
"""

from __future__ import annotations

import os

from gpulaunch.errors import DataError


def is_url(path) -> bool:
    return "://" in str(path)


def url_to_fs(url: str, storage_options: dict | None = None):
    import fsspec

    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except (ImportError, ValueError) as e:
        raise DataError(f"{url}: no filesystem for this URL ({e}); install the fsspec "
                        "implementation for its scheme (s3fs for s3://, gcsfs for gs://)") from e


def explain(url: str, e: BaseException, what: str = "read") -> DataError:
    """A DataError for ``e`` met while reading ``url``: what went wrong and what to do."""
    text = f"{type(e).__name__}: {e}"
    low = text.lower()
    if isinstance(e, DataError):
        return e
    if isinstance(e, FileNotFoundError) or "nosuchkey" in low or "nosuchbucket" in low \
            or "not found" in low or "no such file" in low:
        return DataError(f"{url}: not found ({text}); check the path, bucket and table name")
    if isinstance(e, PermissionError) or any(k in low for k in (
            "accessdenied", "access denied", "invalidaccesskeyid", "signaturedoesnotmatch",
            "forbidden", "403", "expiredtoken", "credentials")):
        return DataError(f"{url}: credentials refused ({text}); check the key, secret and "
                         "endpoint in storage_options (or the AWS_* environment)")
    return DataError(f"{url}: cannot {what} ({text})")


def glob_or_list(url: str, storage_options: dict | None, suffixes: tuple[str, ...]) -> list[str]:
    """The files a path names: itself, a glob's matches, or a folder's files with ``suffixes``
    (recursively, sorted, hidden and ``_``-prefixed names left out as Spark/Delta do)."""
    fs, path = url_to_fs(url, storage_options)
    proto = url.split("://", 1)[0] + "://" if is_url(url) else ""

    def full(p: str) -> str:
        return proto + p if proto and "://" not in p else p

    try:
        if any(ch in path for ch in "*?["):
            found = sorted(fs.glob(path))
        elif fs.isdir(path):
            found = sorted(p for p in fs.find(path)
                           if p.endswith(suffixes) and not any(
                               part.startswith((".", "_")) for part in
                               p[len(path.rstrip("/")):].split("/") if part))
        elif fs.exists(path):
            found = [path]
        else:
            raise FileNotFoundError(path)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - every backend raises its own types
        raise explain(url, e, "list") from e
    if not found:
        raise DataError(f"{url}: no {'/'.join(suffixes)} files there")
    return [full(p) for p in found]


def open_binary(url: str, storage_options: dict | None = None):
    if not is_url(url):
        try:
            return open(url, "rb")
        except OSError as e:
            raise explain(url, e, "open") from e
    fs, path = url_to_fs(url, storage_options)
    try:
        return fs.open(path, "rb")
    except Exception as e:  # noqa: BLE001
        raise explain(url, e, "open") from e


def local_path(url: str) -> str:
    return url[len("file://"):] if url.startswith("file://") else os.fspath(url)
