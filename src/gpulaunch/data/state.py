"""The ``Checkpointable`` protocol and the registry that checkpoints carry by themselves.

Anything with ``state_dict()`` and ``load_state_dict(state)`` can join: a
:class:`~gpulaunch.data.StreamingLoader` registers itself (under ``name="train"`` unless told
otherwise), a user's own dataset or sampler joins with :func:`register`. Then
``gpulaunch.parallel.save_checkpoint`` writes every registered object's state into the
checkpoint (one file per rank), and ``load_checkpoint`` / ``resume`` hand it back: at once to an
object registered under that name, or, when the object is made after the resume, as soon as it
registers. No ``loader=`` argument to remember.

Registered objects are held weakly (a loader that is gone is forgotten). A state waiting for its
object belongs to the call that loaded it: a warm pool's next call does not inherit it.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol, runtime_checkable

from gpulaunch.errors import DataError


@runtime_checkable
class Checkpointable(Protocol):
    """An object whose position a checkpoint keeps: ``state_dict()`` returns plain picklable
    data, ``load_state_dict(state)`` puts the object back there."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


_live: dict[str, weakref.ref] = {}
_waiting: dict[str, tuple[str, dict]] = {}      # name -> (call, state)


def _call() -> str:
    from gpulaunch import runtime as rt

    return f"{rt.get_run_dir()}|{rt.get_restart_count()}"


def register(obj: Checkpointable, name: str = "train") -> None:
    """Let checkpoints carry ``obj``'s state under ``name`` (one object per name at a time)."""
    if not isinstance(obj, Checkpointable):
        raise DataError(f"{type(obj).__name__} cannot be checkpointed: it needs state_dict() "
                        "and load_state_dict(state) (the Checkpointable protocol)")
    old = _live.get(name)
    if old is not None and old() is not None and old() is not obj:
        raise DataError(f"two objects want the checkpoint name {name!r} ({type(old()).__name__} "
                        f"and {type(obj).__name__}); give the second another name= "
                        "(a validation loader: name='val')")
    _live[name] = weakref.ref(obj)
    waiting = _waiting.pop(name, None)
    if waiting is not None and waiting[0] == _call():
        obj.load_state_dict(waiting[1])


def unregister(name: str = "train") -> None:
    _live.pop(name, None)
    _waiting.pop(name, None)


def registered() -> dict[str, Checkpointable]:
    out = {}
    for name, ref in list(_live.items()):
        obj = ref()
        if obj is None:
            del _live[name]
        else:
            out[name] = obj
    return out


def checkpoint_state() -> dict[str, dict]:
    """Every registered object's state, by name (what a checkpoint writes for this rank)."""
    return {name: obj.state_dict() for name, obj in registered().items()}


def restore(states: dict[str, dict]) -> None:
    """Hand saved states back: now to registered objects, later to ones not made yet."""
    live = registered()
    call = _call()
    for name, st in (states or {}).items():
        if name in live:
            live[name].load_state_dict(st)
        else:
            _waiting[name] = (call, st)
