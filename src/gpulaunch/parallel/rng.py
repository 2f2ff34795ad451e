"""The random state a checkpoint carries per rank (torch, CUDA, Python, NumPy), so dropout,
shuffles and sampling resume exactly where they stopped."""

from __future__ import annotations

import random

import torch

__all__ = ["get_state", "set_state"]


def get_state() -> dict:
    st = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        st["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return st


def set_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])
    if "numpy" in st:
        import numpy as np

        np.random.set_state(st["numpy"])
