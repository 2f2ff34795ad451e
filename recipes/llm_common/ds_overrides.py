"""``-x ds.PATH=VALUE``: any key of a recipe's DeepSpeed dict, from the command line.

The ZeRO-3 recipe builds its DeepSpeed dict itself (the seed's, or the tuned one with
``--speed auto``). A user who wants one key otherwise, say ``overlap_comm`` off or the
throughput timer back on, should not have to edit the recipe:

    -x ds.zero_optimization.overlap_comm=false
    -x ds.timers.throughput.enabled=true

The dotted path names nested keys; the value is what ``-x`` already parsed (int, float,
true/false, else the string). The overrides are merged into the dict last, so they win over
both the seed's values and ``--speed auto``'s. ``check`` runs in the parent, before any
process starts: a malformed path fails there, and so does an unknown ``zero_optimization`` key
or a bad value when DeepSpeed is importable there (its own config model says which); the rank
validates the whole dict again when DeepSpeed starts.
"""

from __future__ import annotations

import re

PREFIX = "ds."
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def from_extra(extra: dict) -> dict:
    """The nested dict the ``-x ds.*`` options ask for ({} when there are none)."""
    out: dict = {}
    for name, value in extra.items():
        if not name.startswith(PREFIX):
            continue
        path = name[len(PREFIX):].split(".")
        if not all(_KEY.match(p) for p in path):
            raise SystemExit(f"-x {name}={value}: the path after 'ds.' must be DeepSpeed config "
                             f"keys joined by dots, e.g. -x ds.zero_optimization.overlap_comm=false")
        node = out
        for key in path[:-1]:
            if not isinstance(node.setdefault(key, {}), dict):
                raise SystemExit(f"-x {name}: {key!r} is set to a value by another -x ds. option")
            node = node[key]
        if isinstance(node.get(path[-1]), dict):
            raise SystemExit(f"-x {name}: {path[-1]!r} already holds keys set by another -x ds. option")
        node[path[-1]] = value
    return out



def check(extra: dict, *, technique: str) -> dict:
    """The overrides, checked in the parent: only under ZeRO-3 (the DDP run has no DeepSpeed
    dict), and ``zero_optimization`` against DeepSpeed's own config model where it imports."""
    overrides = from_extra(extra)
    if not overrides:
        return overrides
    if technique != "zero3":
        raise SystemExit(f"-x ds.*: DeepSpeed settings, for -x technique=zero3 only "
                         f"(this run is {technique})")
    zero = overrides.get("zero_optimization")
    if zero:
        try:
            from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
        except ImportError:      # the parent may run without DeepSpeed: the rank checks it
            return overrides
        try:
            DeepSpeedZeroConfig(**{"stage": 3, **zero})
        except Exception as e:   # pydantic's ValidationError names each key and its problem
            errors = getattr(e, "errors", None)
            why = ("; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in errors())
                   if callable(errors) else str(e))
            raise SystemExit(f"-x ds.zero_optimization.*: DeepSpeed refuses it: {why}") from None
    return overrides
