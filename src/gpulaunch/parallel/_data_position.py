"""The data position a checkpoint carries without being asked: the state of every object
registered with :mod:`gpulaunch.data.state` (each ``StreamingLoader`` registers itself), one file
per rank (``data_rank00000.pt``, ...) beside the per-rank RNG files.

On load a rank takes its own file; a rank that the saving run did not have (the world grew) takes
rank 0's: a ``StreamingLoader``'s state is the same on every rank (the positions nobody has seen),
and it re-splits them for the new world size."""

from __future__ import annotations

from ._storage import _exists, _join, _torch_load, _torch_save


def _name(rank: int) -> str:
    return f"data_rank{rank:05d}.pt"


def save(write_dir: str, rank: int) -> None:
    from gpulaunch.data import state

    states = state.checkpoint_state()
    if states:
        _torch_save(states, _join(write_dir, _name(rank)))


def load(ckpt: str, rank: int) -> None:
    from gpulaunch.data import state

    for path in (_join(ckpt, _name(rank)), _join(ckpt, _name(0))):
        if _exists(path):
            state.restore(_torch_load(path))
            return
