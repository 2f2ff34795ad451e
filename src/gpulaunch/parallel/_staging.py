"""Checkpoints to object stores through local disk: write fast, upload in the background.

``save_checkpoint("s3://bucket/ckpts", ...)`` (any fsspec URL; not DeepSpeed, which stages its
own way) writes the whole checkpoint to a node-local folder first - the same files a local save
writes, at local-disk speed - and training goes on while one rank per node uploads its node's
files. When every node's upload is in, rank 0 writes ``COMPLETE`` and points ``latest`` at it: a
reader never sees a checkpoint half uploaded, and a crash mid-upload leaves ``latest`` on the
previous one. The upload is the save in flight of ``parallel._async_save``: the next save, the
end of the rank's function and ``wait_for_checkpoint()`` wait for it (and raise its error).

``load_checkpoint("s3://...")`` downloads the checkpoint once per node (local rank 0), the other
ranks of the node read the local copy, and the copy is removed after the load.

The local folder is ``$GPULAUNCH_STAGE_DIR`` (default: the temp directory), created private
(0700): checkpoints hold the model.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
import uuid
from concurrent.futures import Future

import torch
import torch.distributed as dist

from . import _async_save, _env
from ._storage import _fs

_group = None


def wanted(url: str) -> bool:
    """Object stores and remote filesystems are staged; local paths (``file://`` too) are not."""
    url = str(url)
    return "://" in url and not url.startswith(("file://", "local://"))


def _root() -> str:
    base = os.path.join(os.environ.get("GPULAUNCH_STAGE_DIR") or tempfile.gettempdir(),
                        f"gpulaunch-stage-{os.getuid()}")
    os.makedirs(base, mode=0o700, exist_ok=True)
    return base


def _upload_group():
    global _group
    if _group is None and _env.is_dist():
        _group = dist.new_group(backend="gloo")     # every rank saves: a collective call, fine
    return _group


def stage_dir(uid: str, name: str) -> str:
    """This node's local folder for checkpoint ``name`` of save ``uid`` (made on every rank)."""
    path = os.path.join(_root(), f"save-{uid}", name)
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def upload_then_publish(local_dir: str, final_dir: str, publish) -> str:
    """Upload this node's ``local_dir`` to ``final_dir`` in the background (local rank 0), then,
    once every node's upload succeeded, ``publish()`` on rank 0. Registered as the save in
    flight."""
    group = _upload_group()
    uploader = _env.local_rank() == 0
    future: Future = Future()

    def run():
        error = None
        try:
            if uploader:
                fs, remote = _fs(final_dir)
                fs.put(local_dir.rstrip("/") + "/", remote.rstrip("/") + "/", recursive=True)
        except BaseException as e:  # noqa: BLE001 - reported through the future
            error = e
        try:
            failed = torch.tensor([1 if error is not None else 0])
            if group is not None:
                dist.all_reduce(failed, group=group)
            if error is None and int(failed) == 0 and publish is not None:
                publish()
            elif error is None and int(failed):
                error = RuntimeError(f"another node failed to upload its part of {final_dir}; "
                                     "the checkpoint was not published")
        except BaseException as e:  # noqa: BLE001
            error = error or e
        finally:
            if uploader:
                shutil.rmtree(os.path.dirname(local_dir.rstrip("/")), ignore_errors=True)
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(final_dir)

    future.set_running_or_notify_cancel()
    _async_save.track(future, final_dir)
    threading.Thread(target=run, name="gpulaunch-ckpt-upload", daemon=True).start()
    return final_dir


def fetch(ckpt_url: str, fmt: str = "dcp"):
    """A node-local copy of checkpoint ``ckpt_url`` (downloaded by local rank 0 only) and a
    function that removes it after a barrier; call both on every rank. Local checkpoints and
    DeepSpeed's (staged by DeepSpeed's own loader) are read where they are."""
    if not wanted(ckpt_url) or fmt != "dcp":
        return ckpt_url, _env.barrier
    uid = _broadcast(uuid.uuid4().hex[:12] if _env.rank() == 0 else None)
    key = hashlib.sha1(ckpt_url.encode()).hexdigest()[:12]
    local = os.path.join(_root(), f"load-{uid}-{key}")
    error = None
    if _env.local_rank() == 0:
        try:
            fs, remote = _fs(ckpt_url)
            os.makedirs(local, mode=0o700, exist_ok=True)
            fs.get(remote.rstrip("/") + "/", local + "/", recursive=True)
        except Exception as e:  # noqa: BLE001 - raised on every rank below, no rank left waiting
            error = e
    failed = _any(error is not None)
    if failed:
        if error is not None:
            raise error
        raise RuntimeError(f"another node could not download {ckpt_url}")

    def remove():
        _env.barrier()
        if _env.local_rank() == 0:
            shutil.rmtree(local, ignore_errors=True)
    return local, remove


def _any(flag: bool) -> bool:
    if not _env.is_dist():
        return flag
    t = torch.tensor([1 if flag else 0])
    dist.all_reduce(t, group=_upload_group())
    return bool(int(t))


def _broadcast(obj):
    if not _env.is_dist():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_upload_group())
    return box[0]
