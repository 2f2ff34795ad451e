"""Where checkpoints are written: a local path or an fsspec URL, behind a few small helpers
(atomic small-file writes on local disk, torch save/load through bytes, DCP readers/writers)."""

from __future__ import annotations

import io
import os
import shutil
import tempfile
import uuid

import torch

from ._env import is_url


def _fs(path: str):
    import fsspec

    fs, p = fsspec.core.url_to_fs(path)
    return fs, p


def _join(a: str, *b: str) -> str:
    return "/".join([a.rstrip("/"), *b])


def _exists(path: str) -> bool:
    if is_url(path):
        fs, p = _fs(path)
        return fs.exists(p)
    return os.path.exists(path)


def _read_bytes(path: str) -> bytes:
    if is_url(path):
        fs, p = _fs(path)
        return fs.cat_file(p)
    with open(path, "rb") as f:
        return f.read()


def _write_bytes(path: str, data: bytes) -> None:
    """Write a whole small file; on local disk via a temp file + ``os.replace`` (atomic)."""
    if is_url(path):
        fs, p = _fs(path)
        fs.pipe_file(p, data)
        return
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _torch_save(obj, path: str) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    _write_bytes(path, buf.getvalue())


def _torch_load(path: str):
    # our own files: they may hold user `extra` objects, so full unpickling
    return torch.load(io.BytesIO(_read_bytes(path)), map_location="cpu", weights_only=False)


def _makedirs(path: str) -> None:
    if is_url(path):
        fs, p = _fs(path)
        fs.makedirs(p, exist_ok=True)
    else:
        os.makedirs(path, exist_ok=True)


def _rmtree(path: str) -> None:
    if is_url(path):
        fs, p = _fs(path)
        if fs.exists(p):
            fs.rm(p, recursive=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _listdir(path: str) -> list[str]:
    if is_url(path):
        fs, p = _fs(path)
        if not fs.exists(p):
            return []
        return [e.rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(p, detail=False)]
    return os.listdir(path) if os.path.isdir(path) else []


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _dcp_writer(path: str):
    import torch.distributed.checkpoint as dcp

    if is_url(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(path)
    return dcp.FileSystemWriter(path)


def _dcp_reader(path: str):
    import torch.distributed.checkpoint as dcp

    if is_url(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(path)
    return dcp.FileSystemReader(path)


def _local_stage(uid: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"gpulaunch-ckpt-{uid}")
