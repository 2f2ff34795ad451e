"""Checkpoints for every strategy, published atomically, and ``export()`` to one plain file.

Layout under a checkpoint root (a local path or an fsspec URL)::

    root/
      step_00000010/           one complete checkpoint
        COMPLETE               written last: JSON metadata (strategy, format, step, world size)
        trainer_state.pt       step, user ``extra``, lr scheduler and grad scaler state
        rng_rank00000.pt ...   per-rank RNG state, so dropout etc. resume exactly
        model/ ...             torch Distributed Checkpoint (none/ddp/fsdp) or DeepSpeed's own (zero*)
      latest                   name of the newest complete checkpoint, rewritten last

Atomicity: on a local filesystem every rank writes into ``root/.tmp-step_...-<uuid>``; after a
barrier rank 0 writes ``COMPLETE`` and renames the folder into place, then rewrites ``latest``
(write + ``os.replace``). On object stores, where rename is a copy, the files go straight into
``step_...`` and ``COMPLETE`` is written last; a folder without ``COMPLETE`` is treated as absent.
Either way a crash mid-save leaves the previous checkpoint the newest loadable one.

DDP/FSDP checkpoints are sharded (no full-state-dict gather on any rank, so no host-RAM blow-up),
keyed by the plain module's parameter names, so one saved under DDP loads under FSDP and vice versa,
at another world size too.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
import tempfile
import time
import uuid
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from . import _env
from ._env import ParallelError, is_url
from .strategies import DeepSpeedPrepared, Prepared, TorchPrepared

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "list_checkpoints", "export"]

MARKER = "COMPLETE"
LATEST = "latest"
_STEP_RE = re.compile(r"^step_(\d+)$")
_DS_TAG = "ds"


# ---------------------------------------------------------------- filesystem helpers
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


# ---------------------------------------------------------------- discovery
def _meta(ckpt_dir: str) -> Optional[dict]:
    m = _join(ckpt_dir, MARKER)
    if not _exists(m):
        return None
    try:
        return json.loads(_read_bytes(m))
    except (ValueError, OSError):
        return None


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """Complete checkpoints under ``root`` as ``(step, path)``, oldest first."""
    out = []
    for name in _listdir(str(root)):
        m = _STEP_RE.match(name)
        if m and _meta(_join(str(root), name)) is not None:
            out.append((int(m.group(1)), _join(str(root), name)))
    return sorted(out)


def latest_checkpoint(root: str) -> Optional[str]:
    """The newest complete checkpoint under ``root`` (or ``root`` itself if it is one), else None."""
    root = str(root)
    if _meta(root) is not None:
        return root
    p = _join(root, LATEST)
    if _exists(p):
        name = _read_bytes(p).decode().strip()
        cand = _join(root, name)
        if _STEP_RE.match(name) and _meta(cand) is not None:
            return cand
    found = list_checkpoints(root)  # pointer missing or stale: fall back to the newest complete one
    return found[-1][1] if found else None


def _resolve(path: str, step: Optional[int]) -> str:
    path = str(path)
    if step is not None:
        cand = _join(path, f"step_{step:08d}")
        if _meta(cand) is None:
            raise FileNotFoundError(f"no complete checkpoint for step {step} under {path} "
                                    f"(complete: {[s for s, _ in list_checkpoints(path)]})")
        return cand
    found = latest_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"no complete checkpoint under {path}")
    return found


# ---------------------------------------------------------------- collectives
def _broadcast(obj):
    if not _env.is_dist():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _rng_state() -> dict:
    st = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        st["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return st


def _set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])
    if "numpy" in st:
        import numpy as np

        np.random.set_state(st["numpy"])


# ---------------------------------------------------------------- what to save
def _as_prepared(target, optimizer) -> Prepared:
    if isinstance(target, Prepared):
        if optimizer is not None:
            raise ParallelError("pass either a Prepared object or (model, optimizer=...), not both")
        return target
    if isinstance(target, nn.Module):
        from torch.nn.parallel import DistributedDataParallel as DDP

        inner = target.module if isinstance(target, DDP) else target
        strategy = "ddp" if isinstance(target, DDP) else "none"
        try:
            from torch.distributed.fsdp import FSDPModule

            if isinstance(target, FSDPModule):
                strategy = "fsdp"
        except ImportError:
            pass
        return TorchPrepared(strategy, target, optimizer, None, None, 1, None, None, None, inner)
    raise ParallelError(f"save/load_checkpoint takes what prepare() returned or an nn.Module, got "
                        f"{type(target).__name__}")


def _format(p: Prepared) -> str:
    return "deepspeed" if isinstance(p, DeepSpeedPrepared) else "dcp"


def _write_payload(p: Prepared, ckpt_dir: str) -> None:
    """Every rank writes its part of the model/optimizer state into ``ckpt_dir``."""
    if isinstance(p, DeepSpeedPrepared):
        _write_deepspeed(p, ckpt_dir)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if p.optimizer is not None:
        msd, osd = get_state_dict(p.model, p.optimizer)
        state = {"model": msd, "optim": osd}
    else:
        state = {"model": get_model_state_dict(p.model)}
    dcp.save(state, storage_writer=_dcp_writer(_join(ckpt_dir, "model")))


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


def _write_deepspeed(p: DeepSpeedPrepared, ckpt_dir: str) -> None:
    if not is_url(ckpt_dir):
        p.engine.save_checkpoint(_join(ckpt_dir, "model"), tag=_DS_TAG, save_latest=False)
        return
    # DeepSpeed writes local files only: stage on this host, then one rank per host uploads them
    uid = _broadcast(uuid.uuid4().hex[:12] if _env.rank() == 0 else None)
    stage = _local_stage(uid)
    try:
        p.engine.save_checkpoint(stage, tag=_DS_TAG, save_latest=False)
        _env.barrier()
        if _env.local_rank() == 0:
            fs, remote = _fs(_join(ckpt_dir, "model"))
            fs.put(stage.rstrip("/") + "/", remote, recursive=True)
        _env.barrier()
    finally:
        if _env.local_rank() == 0:
            shutil.rmtree(stage, ignore_errors=True)


def _publish(tmp_dir: Optional[str], final_dir: str, root: str, meta: dict) -> None:
    """Rank 0, after every rank wrote its part: mark complete, move into place, point ``latest`` at it."""
    if tmp_dir is None:  # object store: files are already in final_dir; the marker makes it count
        _write_bytes(_join(final_dir, MARKER), json.dumps(meta).encode())
    else:
        _write_bytes(os.path.join(tmp_dir, MARKER), json.dumps(meta).encode())
        _fsync_dir(tmp_dir)
        if os.path.exists(final_dir):  # re-saving a step: swap the old one out, then drop it
            old = f"{final_dir}.old-{uuid.uuid4().hex[:8]}"
            os.rename(final_dir, old)
            os.rename(tmp_dir, final_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp_dir, final_dir)
        _fsync_dir(root)
    _write_bytes(_join(root, LATEST), os.path.basename(final_dir.rstrip("/")).encode())


def save_checkpoint(path, prepared, *, step: int, extra: Any = None, optimizer=None,
                    keep: Optional[int] = None) -> str:
    """Save a checkpoint for ``step`` under the root ``path``; call it on every rank.

    ``prepared`` is what :func:`prepare` returned (or an ``nn.Module`` plus ``optimizer=``).
    ``extra`` is any picklable object (epoch, data position, config), returned by
    :func:`load_checkpoint`. ``keep=N`` deletes all but the newest N complete checkpoints.
    Returns the checkpoint's folder.
    """
    p = _as_prepared(prepared, optimizer)
    if not isinstance(step, int) or step < 0:
        raise ParallelError(f"step must be an int >= 0, got {step!r}")
    root = str(path)
    name = f"step_{step:08d}"
    final_dir = _join(root, name)
    url = is_url(root)
    r = _env.rank()

    if r == 0:
        _makedirs(root)
        if not url:  # leftovers of saves that crashed before publishing
            for n in _listdir(root):
                if n.startswith(".tmp-") or ".old-" in n:
                    shutil.rmtree(os.path.join(root, n), ignore_errors=True)
        elif _exists(_join(final_dir, MARKER)):
            # overwriting this step in place: first make it count as absent
            fs, pp = _fs(_join(final_dir, MARKER))
            fs.rm(pp)
    uid = _broadcast(uuid.uuid4().hex[:12] if r == 0 else None)
    _env.barrier()
    write_dir = final_dir if url else os.path.join(root, f".tmp-{name}-{uid}")
    if r == 0:
        _makedirs(write_dir)
    _env.barrier()

    _write_payload(p, write_dir)
    _torch_save(_rng_state(), _join(write_dir, f"rng_rank{r:05d}.pt"))
    if r == 0:
        state = {"step": step, "extra": extra, "micro": p._micro, "strategy": p.strategy}
        if isinstance(p, TorchPrepared):
            if p.lr_scheduler is not None:
                state["lr_scheduler"] = p.lr_scheduler.state_dict()
            if p.scaler is not None:
                state["scaler"] = p.scaler.state_dict()
        _torch_save(state, _join(write_dir, "trainer_state.pt"))
    _env.barrier()  # every rank's part is on storage

    if r == 0:
        meta = {"step": step, "strategy": p.strategy, "format": _format(p), "world_size": _env.world_size(),
                "mixed_precision": p.mixed_precision, "time": time.time(), "torch": torch.__version__}
        _publish(None if url else write_dir, final_dir, root, meta)
        if keep:
            for _, old in list_checkpoints(root)[:-keep]:
                _rmtree(old)
    _env.barrier()
    return final_dir


def load_checkpoint(path, prepared, *, step: Optional[int] = None, optimizer=None,
                    load_optimizer: bool = True, strict: bool = True) -> dict:
    """Load the newest complete checkpoint under ``path`` (or ``step``'s, or ``path`` itself).

    Call it on every rank, after :func:`prepare`. Restores model, optimizer, lr scheduler, grad scaler,
    accumulation position and each rank's RNG. Returns ``{"step", "extra", "path"}``.
    Raises ``FileNotFoundError`` when there is none: use :func:`latest_checkpoint` to test first.
    """
    p = _as_prepared(prepared, optimizer)
    ckpt = _resolve(str(path), step)
    meta = _meta(ckpt)
    fmt = _format(p)
    if meta["format"] != fmt:
        raise ParallelError(
            f"{ckpt} was saved by strategy {meta['strategy']!r} ({meta['format']} format) and cannot be "
            f"loaded as {p.strategy!r}: export() it to one file and load that into the plain model "
            "before prepare(), or resume with the strategy it was saved with.")

    if isinstance(p, DeepSpeedPrepared):
        _load_deepspeed(p, ckpt, load_optimizer)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_state_dict, set_model_state_dict,
                                                             set_state_dict)

        opts = StateDictOptions(strict=strict)
        if p.optimizer is not None and load_optimizer:
            msd, osd = get_state_dict(p.model, p.optimizer)
            state = {"model": msd, "optim": osd}
            dcp.load(state, storage_reader=_dcp_reader(_join(ckpt, "model")))
            set_state_dict(p.model, p.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"], options=opts)
        else:
            state = {"model": get_model_state_dict(p.model)}
            dcp.load(state, storage_reader=_dcp_reader(_join(ckpt, "model")))
            set_model_state_dict(p.model, state["model"], options=opts)

    ts = _torch_load(_join(ckpt, "trainer_state.pt"))
    if isinstance(p, TorchPrepared):
        p._micro = ts.get("micro", 0)
        if p.lr_scheduler is not None and "lr_scheduler" in ts:
            p.lr_scheduler.load_state_dict(ts["lr_scheduler"])
        if p.scaler is not None and "scaler" in ts:
            p.scaler.load_state_dict(ts["scaler"])
    rng = _join(ckpt, f"rng_rank{_env.rank():05d}.pt")
    if meta["world_size"] == _env.world_size() and _exists(rng):
        _set_rng_state(_torch_load(rng))
    _env.barrier()
    return {"step": ts["step"], "extra": ts.get("extra"), "path": ckpt}


def _load_deepspeed(p: DeepSpeedPrepared, ckpt: str, load_optimizer: bool) -> None:
    src = _join(ckpt, "model")
    stage = None
    if is_url(ckpt):
        uid = _broadcast(uuid.uuid4().hex[:12] if _env.rank() == 0 else None)
        stage = _local_stage(uid)
        if _env.local_rank() == 0:
            fs, remote = _fs(src)
            fs.get(remote.rstrip("/") + "/", stage, recursive=True)
        _env.barrier()
        src = stage
    try:
        path, _ = p.engine.load_checkpoint(src, tag=_DS_TAG, load_optimizer_states=load_optimizer,
                                           load_lr_scheduler_states=load_optimizer)
        if path is None:
            raise ParallelError(f"DeepSpeed could not load the checkpoint in {ckpt}")
    finally:
        if stage is not None:
            _env.barrier()
            if _env.local_rank() == 0:
                shutil.rmtree(stage, ignore_errors=True)


# ---------------------------------------------------------------- export
def export(path, out: Optional[str] = None, *, step: Optional[int] = None,
           dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """Consolidate any strategy's checkpoint into one plain ``state_dict`` (run it in ONE process).

    ``path`` is a checkpoint root or folder. With ``out`` ending in ``.safetensors`` the weights are
    written with safetensors, otherwise with ``torch.save``; local files are written atomically.
    The result loads into the non-distributed model with ``model.load_state_dict(...)``. Needs host
    RAM for the full model (fp32) plus, for ZeRO, DeepSpeed's fp32 partitions while merging.
    """
    ckpt = _resolve(str(path), step)
    meta = _meta(ckpt)
    if meta["format"] == "deepspeed":
        sd = _export_deepspeed(ckpt)
    else:
        sd = _export_dcp(ckpt)
    sd = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
          for k, v in sd.items()}
    if out is not None:
        out = str(out)
        if out.endswith(".safetensors"):
            from safetensors.torch import save as st_save

            # safetensors refuses tensors that share memory (tied weights): give each its own
            seen, clean = set(), {}
            for k, v in sd.items():
                ptr = (v.untyped_storage().data_ptr(), v.storage_offset())
                clean[k] = v.clone() if ptr in seen else v
                seen.add(ptr)
            _write_bytes(out, st_save(clean, metadata={"format": "pt", "step": str(meta["step"]),
                                                       "strategy": meta["strategy"]}))
        else:
            _torch_save(sd, out)
    return sd


def _export_dcp(ckpt: str) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd: dict[str, Any] = {}
    _load_state_dict(sd, storage_reader=_dcp_reader(_join(ckpt, "model")),
                     planner=_EmptyStateDictLoadPlanner(keys={"model"}), no_dist=True)
    return dict(sd["model"])


def _export_deepspeed(ckpt: str) -> dict[str, torch.Tensor]:
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as e:
        raise ParallelError(f"exporting a ZeRO checkpoint needs DeepSpeed installed: {e}") from e
    src = _join(ckpt, "model")
    if is_url(ckpt):
        with tempfile.TemporaryDirectory() as d:
            fs, remote = _fs(src)
            fs.get(remote.rstrip("/") + "/", d, recursive=True)
            return dict(get_fp32_state_dict_from_zero_checkpoint(d, tag=_DS_TAG))
    return dict(get_fp32_state_dict_from_zero_checkpoint(src, tag=_DS_TAG))
