"""Turn whatever the caller has (module, config path, catalog name, ModelShape) into a ModelShape."""
from __future__ import annotations

import os

from . import catalog, hf_config
from .shapes import ModelShape


def resolve_model(model) -> ModelShape:
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, (str, os.PathLike)):
        s = str(model)
        found = catalog.lookup(s)
        if found is not None:
            return found
        if os.path.exists(s):
            return hf_config.load(s)
        raise ValueError(f"unknown model {s!r}: not a built-in name ({', '.join(catalog.names())}) and no "
                         f"such config file or directory")
    if hasattr(model, "parameters") and hasattr(model, "modules"):
        from .from_module import from_module
        return from_module(model)
    raise TypeError(f"model must be an nn.Module, a config path, a built-in name or a ModelShape, "
                    f"not {type(model).__name__}")
