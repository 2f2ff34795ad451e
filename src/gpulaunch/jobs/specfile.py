"""A job spec file as plain values plus where each value was written, so that an error can
name the key and its line (``spec.yaml:7: compute.gpus: ...``).

PyYAML's composer keeps a start mark on every node; we build the Python values ourselves from
those nodes (safe scalars only: YAML's own tags, no Python objects) and note each key's line
under its dotted path. ``--override key=value`` edits the values afterwards and marks the path
as coming from the command line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigurationError


class SpecError(ConfigurationError):
    """A job spec that cannot run; the message names the file, line and key, and the fix."""


class Located:
    """The spec's values and the line each dotted key was written on."""

    def __init__(self, data: dict, lines: dict[str, int], source: str):
        self.data = data
        self.lines = lines
        self.source = source          # the file's path, or "<text>"
        self.overridden: set[str] = set()

    def where(self, path: str) -> str:
        """``file:line: path`` for an error message (the nearest written parent's line)."""
        if path in self.overridden:
            return f"--override {path}"
        probe = path
        while probe:
            if probe in self.lines:
                return f"{self.source}:{self.lines[probe]}: {path}"
            probe = probe.rpartition(".")[0]
        return f"{self.source}: {path}"

    def error(self, path: str, message: str) -> SpecError:
        return SpecError(f"{self.where(path)}: {message}")


def _construct(node, path: str, lines: dict[str, int], loader) -> Any:
    if isinstance(node, yaml.MappingNode):
        out: dict = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            if not isinstance(key, str):
                raise SpecError(f"line {key_node.start_mark.line + 1}: keys are names, got "
                                f"{key!r}")
            child = f"{path}.{key}" if path else key
            if key in out:
                raise SpecError(f"line {key_node.start_mark.line + 1}: {child} is given twice")
            lines[child] = key_node.start_mark.line + 1
            out[key] = _construct(value_node, child, lines, loader)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_construct(n, f"{path}[{i}]", lines, loader) for i, n in enumerate(node.value)]
    return loader.construct_object(node, deep=True)


def parse(text: str, source: str = "<text>") -> Located:
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
    except yaml.YAMLError as e:
        raise SpecError(f"{source}: not valid YAML: {e}") from None
    finally:
        loader.dispose()
    if node is None:
        raise SpecError(f"{source}: the spec is empty; it needs at least name: and command:")
    if not isinstance(node, yaml.MappingNode):
        raise SpecError(f"{source}:{node.start_mark.line + 1}: a job spec is a mapping of "
                        "sections (name:, compute:, command:, ...)")
    lines: dict[str, int] = {}
    loader = yaml.SafeLoader("")
    try:
        data = _construct(node, "", lines, loader)
    finally:
        loader.dispose()
    return Located(data, lines, source)


def load(path: str | Path) -> Located:
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise SpecError(f"job spec {str(path)!r} not found") from None
    except OSError as e:
        raise SpecError(f"job spec {str(path)!r} cannot be read: {e}") from None
    return parse(text, str(path))


def apply_override(located: Located, item: str) -> None:
    """``compute.gpus=4``, ``launch.timeout=3600``, ``environment.env.LR=0.1``: the value is
    read as YAML (``4`` is a number, ``[a, b]`` a list, ``null`` None); missing sections are
    created, a key below a scalar is refused."""
    path, sep, raw = item.partition("=")
    path = path.strip()
    if not sep or not path or any(not part for part in path.split(".")):
        raise SpecError(f"--override takes KEY=VALUE with a dotted key (compute.gpus=4); "
                        f"got {item!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise SpecError(f"--override {path}: the value {raw!r} is not valid YAML: {e}") from None
    parts = path.split(".")
    node = located.data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise SpecError(f"--override {path}: {'.'.join(parts[:i + 1])} is "
                            f"{type(child).__name__} {child!r}, not a section")
        node = child
    node[parts[-1]] = value
    located.overridden.add(path)
