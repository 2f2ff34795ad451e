"""Dataclasses to JSON and back, by their type hints: the codec of every record that crosses a
process boundary (``records.py``).

Only what the records use is supported: str/int/float/bool/None, enums, nested record
dataclasses, ``list[X]``, ``tuple[X, ...]``, ``dict[K, V]`` (int keys become JSON strings and
come back as ints) and ``X | None``. Unknown keys are ignored when reading, so an older reader
survives a newer writer's extra fields; a missing field takes its default.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import types
import typing
from pathlib import Path
from typing import Any


def to_data(value: Any) -> Any:
    """A JSON-ready copy of ``value`` (records, enums, containers, plain values)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k) if not isinstance(k, str) else k: to_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_data(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_data(tp: Any, data: Any) -> Any:
    """Rebuild a value of type ``tp`` from what ``to_data`` produced."""
    if data is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        for option in options:
            try:
                return from_data(option, data)
            except (TypeError, ValueError, KeyError):
                continue
        raise ValueError(f"{data!r} matches none of {options}")
    if origin in (list, tuple):
        args = typing.get_args(tp)
        item = args[0] if args else Any
        items = [from_data(item, v) for v in data]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        key_t, val_t = (typing.get_args(tp) or (Any, Any))
        return {(int(k) if key_t is int else k): from_data(val_t, v) for k, v in data.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(data, dict):
            raise TypeError(f"{tp.__name__} expects an object, got {type(data).__name__}")
        hints = _hints(tp)
        kwargs = {f.name: from_data(hints[f.name], data[f.name])
                  for f in dataclasses.fields(tp) if f.init and f.name in data}
        return tp(**kwargs)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(data)
    if tp is float and isinstance(data, int) and not isinstance(data, bool):
        return float(data)
    if tp in (int, float, str, bool) and not isinstance(data, tp):
        raise TypeError(f"expected {tp.__name__}, got {data!r}")
    return data


class Record:
    """Mixin for record dataclasses: ``to_json()`` / ``from_json()`` and file helpers."""

    def to_data(self) -> dict:
        return to_data(self)

    def to_json(self) -> str:
        return json.dumps(self.to_data(), indent=1, default=str)

    @classmethod
    def from_data(cls, data: dict):
        return from_data(cls, data)

    @classmethod
    def from_json(cls, text: str):
        return cls.from_data(json.loads(text))
