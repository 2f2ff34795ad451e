"""Find the repeated blocks (transformer layers) of a model, the unit FSDP2 shards and checkpoints."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from torch import nn

from ._env import ParallelError

BlockSpec = type | str | Sequence[type | str] | Callable[[nn.Module], bool] | Iterable[nn.Module] | None


def _numel(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def find_blocks(model: nn.Module, blocks: BlockSpec = None) -> list[nn.Module]:
    """The modules to wrap one by one, in model order.

    ``blocks`` may be: ``None`` (auto: the largest class repeated inside an ``nn.ModuleList`` /
    ``nn.Sequential``, e.g. ``LlamaDecoderLayer``), a class, a class name, a list of either,
    a predicate ``fn(module) -> bool``, or an explicit list of modules.
    """
    if blocks is None:
        return _auto_blocks(model)
    if isinstance(blocks, (type, str)):
        blocks = [blocks]
    if callable(blocks) and not isinstance(blocks, (list, tuple, nn.Module)):
        found = [m for m in model.modules() if m is not model and blocks(m)]
    else:
        blocks = list(blocks)
        if blocks and all(isinstance(b, nn.Module) for b in blocks):
            return blocks
        if not all(isinstance(b, (type, str)) for b in blocks):
            raise ParallelError("blocks= takes a class, a class name, a list of them, a predicate, "
                                "or a list of modules")
        types = tuple(b for b in blocks if isinstance(b, type))
        names = {b for b in blocks if isinstance(b, str)}
        found = [m for m in model.modules() if m is not model
                 and (isinstance(m, types) or type(m).__name__ in names)]
        if not found:
            raise ParallelError(f"blocks={blocks!r} matched no submodule of {type(model).__name__}; "
                                f"its module classes are {sorted({type(m).__name__ for m in model.modules()})}")
    # outermost only: a matched module inside another matched module is covered by its parent
    ids = {id(m) for m in found}
    out = []
    for m in found:
        if not any(id(sub) in ids for sub in _ancestors(model, m)):
            out.append(m)
    return out


def _ancestors(root: nn.Module, target: nn.Module) -> list[nn.Module]:
    path: list[nn.Module] = []

    def walk(m, stack):
        if m is target:
            path.extend(stack)
            return True
        return any(walk(c, stack + [m]) for c in m.children())

    walk(root, [])
    return [m for m in path if m is not root]


def _auto_blocks(model: nn.Module) -> list[nn.Module]:
    best: list[nn.Module] = []
    best_size = 0
    for container in model.modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(container.children())
        counts = Counter(type(c) for c in children)
        for cls, n in counts.items():
            if n < 2 or cls in (nn.ModuleList, nn.Sequential):
                continue
            members = [c for c in children if type(c) is cls]
            size = sum(_numel(c) for c in members)
            if size > best_size:
                best, best_size = members, size
    return best
