"""``export()``: any strategy's checkpoint consolidated into one plain ``state_dict`` file."""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from ._env import ParallelError, is_url
from ._storage import _dcp_reader, _fs, _join, _torch_save, _write_bytes
from .checkpoint import _DS_TAG, _meta, _resolve

__all__ = ["export"]


def export(path, out: str | None = None, *, step: int | None = None,
           dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
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
