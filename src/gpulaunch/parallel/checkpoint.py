"""Checkpoints for every strategy, published atomically, and ``export()`` to one plain file.

Layout under a checkpoint root (a local path or an fsspec URL)::

    root/
      step_00000010/           one complete checkpoint
        COMPLETE               written last: JSON metadata (strategy, format, step, world size)
        trainer_state.pt       step, user ``extra``, lr scheduler and grad scaler state
        rng_rank00000.pt ...   per-rank RNG state, so dropout etc. resume exactly
        model/ ...             torch Distributed Checkpoint (none/ddp/fsdp) or DeepSpeed's own (zero*)
      latest                   name of the newest complete checkpoint, rewritten last

Atomicity: locally every rank writes into ``root/.tmp-step_...-<uuid>``; after a barrier rank 0
writes ``COMPLETE``, renames the folder into place and rewrites ``latest``. To an object store the
files go to local disk, are uploaded in the background, then ``COMPLETE`` is written (``_staging``).
A crash mid-save leaves the previous checkpoint the newest loadable one.

DDP/FSDP checkpoints are sharded (no full-state-dict gather on any rank), keyed by the plain
module's parameter names: one saved under DDP loads under FSDP and vice versa, at another world size.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..common import diskfull
from . import _async_save, _data_position, _env, _staging, rng
from ._env import ParallelError, is_url
from ._storage import (
    _dcp_reader,
    _dcp_writer,
    _exists,
    _fs,
    _fsync_dir,
    _join,
    _listdir,
    _local_stage,
    _makedirs,
    _read_bytes,
    _rmtree,
    _torch_load,
    _torch_save,
    _write_bytes,
)
from .prepared import DeepSpeedPrepared, Prepared, TorchPrepared

__all__ = ["latest_checkpoint", "list_checkpoints", "load_checkpoint", "save_checkpoint",
           "wait_for_checkpoint"]
wait_for_checkpoint = _async_save.wait_for_checkpoint

MARKER = "COMPLETE"
LATEST = "latest"
_STEP_RE = re.compile(r"^step_(\d+)$")
_DS_TAG = "ds"


# ---------------------------------------------------------------- discovery
def _meta(ckpt_dir: str) -> dict | None:
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


def latest_checkpoint(root: str) -> str | None:
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


def _resolve(path: str, step: int | None) -> str:
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


# ---------------------------------------------------------------- what to save
def _as_prepared(target, optimizer) -> Prepared:
    if isinstance(target, Prepared):
        if target.strategy == "ft":
            raise ParallelError(
                "save/load_checkpoint does not take a fault_tolerant=True Prepared: every replica group is "
                "its own one-rank world, so they would all write the same folder. A restarted group heals "
                "from a live peer without a checkpoint; to keep one anyway, save from one group: "
                "`if ft.replica_id() == 0: torch.save(p.unwrap().state_dict(), path)`.")
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

    dcp.save(_dcp_state(p), storage_writer=_dcp_writer(_join(ckpt_dir, "model")))


def _dcp_state(p: Prepared) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if p.optimizer is not None:
        msd, osd = get_state_dict(p.model, p.optimizer)
        return {"model": msd, "optim": osd}
    return {"model": get_model_state_dict(p.model)}


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


def _publish(tmp_dir: str | None, final_dir: str, root: str, meta: dict) -> None:
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
                    keep: int | None = None, loader=None, async_save: bool = False) -> str:
    """Save a checkpoint for ``step`` under the root ``path``; call it on every rank.

    ``prepared`` is what :func:`prepare` returned (or an ``nn.Module`` plus ``optimizer=``).
    ``extra`` is any picklable object (epoch, data position, config), returned by
    :func:`load_checkpoint`. ``keep=N`` deletes all but the newest N complete checkpoints.
    ``loader``: a :func:`distributed_loader`'s data position (epoch, batches consumed) is saved
    too, for :func:`resume`. Returns the checkpoint's folder.

    ``async_save=True`` (DDP/FSDP/none): training stops only while the state is copied to host
    memory; it is written in the background and published (``COMPLETE``, ``latest``) when
    complete. The next save, the end of the rank's function, or :func:`wait_for_checkpoint`
    waits for it (``parallel._async_save``). The returned folder exists once published.
    """
    _async_save.wait_for_checkpoint()      # one save in flight at a time; raises its error
    p = _as_prepared(prepared, optimizer)
    if async_save and isinstance(p, DeepSpeedPrepared):
        raise ParallelError("async_save=True needs a torch-DCP strategy (none, ddp, fsdp); "
                            "DeepSpeed ZeRO writes its own checkpoints: save synchronously")
    if not isinstance(step, int) or step < 0:
        raise ParallelError(f"step must be an int >= 0, got {step!r}")
    root = str(path)
    name = f"step_{step:08d}"
    final_dir = _join(root, name)
    url, staged = is_url(root), _staging.wanted(root) and not isinstance(p, DeepSpeedPrepared)
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
    write_dir = (_staging.stage_dir(uid, name) if staged else final_dir) if url else \
        os.path.join(root, f".tmp-{name}-{uid}")
    if r == 0:
        _makedirs(write_dir)
    _env.barrier()

    with diskfull.named(root, f"saving checkpoint step {step}"):  # a full disk says so
        if not async_save or staged:
            _write_payload(p, write_dir)
        _torch_save(rng.get_state(), _join(write_dir, f"rng_rank{r:05d}.pt"))
        _data_position.save(write_dir, r)   # registered loaders' positions (gpulaunch.data)
        if r == 0:
            state = {"step": step, "extra": extra, "micro": p._micro, "strategy": p.strategy}
            if loader is not None:
                state["loader"] = loader.state_dict()
            if isinstance(p, TorchPrepared):
                if p.lr_scheduler is not None:
                    state["lr_scheduler"] = p.lr_scheduler.state_dict()
                if p.scaler is not None:
                    state["scaler"] = p.scaler.state_dict()
            _torch_save(state, _join(write_dir, "trainer_state.pt"))
    _env.barrier()  # every rank's part is on storage (async: all but the model's)

    def publish():
        meta = {"step": step, "strategy": p.strategy, "format": _format(p), "world_size": _env.world_size(),
                "mixed_precision": p.mixed_precision, "time": time.time(), "torch": torch.__version__, "mesh": p.mesh and p.mesh.spec.sizes}
        _publish(None if url else write_dir, final_dir, root, meta)
        if keep:
            for _, old in list_checkpoints(root)[:-keep]:
                _rmtree(old)

    if staged:
        return _staging.upload_then_publish(write_dir, final_dir, publish if r == 0 else None)
    if async_save:
        _async_save.start(_dcp_state(p), _dcp_writer(_join(write_dir, "model")), final_dir,
                          publish if r == 0 else None)
        return final_dir
    if r == 0:
        publish()
    _env.barrier()
    return final_dir


def load_checkpoint(path, prepared, *, step: int | None = None, optimizer=None,
                    load_optimizer: bool = True, strict: bool = True, loader=None) -> dict:
    """Load the newest complete checkpoint under ``path`` (or ``step``'s, or ``path`` itself).

    Call it on every rank, after :func:`prepare`. Restores model, optimizer, lr scheduler, grad scaler,
    accumulation position and each rank's RNG, and ``loader``'s data position when given.
    Returns ``{"step", "extra", "path"}``.
    Raises ``FileNotFoundError`` when there is none: use :func:`latest_checkpoint` to test first.
    """
    _async_save.wait_for_checkpoint()      # a save in flight is the newest: let it land
    p = _as_prepared(prepared, optimizer)
    ckpt = _resolve(str(path), step)
    meta = _meta(ckpt)
    fmt = _format(p)
    if meta["format"] != fmt:
        raise ParallelError(
            f"{ckpt} was saved by strategy {meta['strategy']!r} ({meta['format']} format) and cannot be "
            f"loaded as {p.strategy!r}: export() it to one file and load that into the plain model "
            "before prepare(), or resume with the strategy it was saved with.")

    src, done = _staging.fetch(ckpt, fmt)   # an object store's: a local copy, once per node
    if isinstance(p, DeepSpeedPrepared):
        _load_deepspeed(p, ckpt, load_optimizer)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_state_dict,
            set_model_state_dict,
            set_state_dict,
        )

        opts = StateDictOptions(strict=strict)
        if p.optimizer is not None and load_optimizer:
            msd, osd = get_state_dict(p.model, p.optimizer)
            state = {"model": msd, "optim": osd}
            dcp.load(state, storage_reader=_dcp_reader(_join(src, "model")))
            set_state_dict(p.model, p.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"], options=opts)
        else:
            state = {"model": get_model_state_dict(p.model)}
            dcp.load(state, storage_reader=_dcp_reader(_join(src, "model")))
            set_model_state_dict(p.model, state["model"], options=opts)

    ts = _torch_load(_join(src, "trainer_state.pt"))
    if isinstance(p, TorchPrepared):
        p._micro = ts.get("micro", 0)
        if p.lr_scheduler is not None and "lr_scheduler" in ts:
            p.lr_scheduler.load_state_dict(ts["lr_scheduler"])
        if p.scaler is not None and "scaler" in ts:
            p.scaler.load_state_dict(ts["scaler"])
    _data_position.load(src, _env.rank())
    if loader is not None and ts.get("loader") is not None:
        loader.load_state_dict(ts["loader"])
    rng_file = _join(src, f"rng_rank{_env.rank():05d}.pt")
    if meta["world_size"] == _env.world_size() and _exists(rng_file):
        rng.set_state(_torch_load(rng_file))
    done()                                   # a barrier (and the local copy removed)
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
