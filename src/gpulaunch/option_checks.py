"""The value checks and ``gpulaunch run`` text parsers of the ``LaunchOptions`` fields.

Each check takes what the user passed and returns the canonical value, or raises a
``ConfigurationError`` that names the setting, what it got and what it takes. They need only
the value (never the host), so they run when ``@distributed(...)`` is applied.
"""

from __future__ import annotations

import math
import numbers
from typing import Callable

from .common import constants
from .errors import ConfigurationError, GPUValidationError

LOG_MODES = ("all", "rank0", "none")


# --------------------------------------------------------------------------- value checks
def check_count(value, name: str = "gpus") -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise GPUValidationError(f"{name} must be a positive int (or None for every GPU here), "
                                 f"got {value!r} of type {type(value).__name__}.")
    if value < 1:
        raise GPUValidationError(f"{name} must be at least 1, got {value}. Use {name}=None to "
                                 "use every GPU on this host.")
    return int(value)


def seconds(name: str, allow_none: bool = True) -> Callable:
    def check(value):
        if value is None and allow_none:
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                or not math.isfinite(value) or value <= 0:
            raise ConfigurationError(f"{name} must be a positive number of seconds"
                                     f"{' or None' if allow_none else ''}, got {value!r}.")
        return float(value)
    return check


def restarts(value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ConfigurationError(f"max_restarts must be an int >= 0, got {value!r}.")
    return int(value)


def preemptions(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ConfigurationError(f"max_preemptions must be an int >= 0, got {value!r}.")
    return int(value)


PREEMPT_WATCH_CLOUDS = ("aws", "gcp", "azure")


def preempt_watch(value, name: str = "preempt_watch") -> str | None:
    """The cloud whose instance metadata service the caller watches for a preemption notice."""
    if value is None or value is False:
        return None
    word = value.strip().lower() if isinstance(value, str) else None
    if word in ("", "none", "off"):
        return None
    if word not in PREEMPT_WATCH_CLOUDS:
        raise ConfigurationError(
            f"{name}={value!r}: not a cloud gpulaunch watches for preemption notices; choose "
            f"{', '.join(repr(c) for c in PREEMPT_WATCH_CLOUDS)} (or None: off).")
    return word


def normalize_stream_logs(value) -> str | tuple[int, ...]:
    if value is True:
        return "all"
    if value is False or value is None:
        return "none"
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("0", "rank0", "rank 0"):
            return "rank0"
        if v in LOG_MODES:
            return v
        if v and all(p.strip().isdigit() for p in v.split(",")):
            return tuple(sorted(int(p) for p in v.split(",")))
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return (int(value),)
    if isinstance(value, (list, tuple, set, frozenset)) and all(
            isinstance(r, numbers.Integral) and not isinstance(r, bool) for r in value):
        return tuple(sorted(int(r) for r in value))
    raise ConfigurationError(f"stream_logs must be 'all', 'rank0', 'none', True/False, a rank or "
                             f"a list of ranks (CLI: 0,2); got {value!r}.")


def env(value) -> tuple[tuple[str, str], ...]:
    if not value:
        return ()
    items = value.items() if isinstance(value, dict) else value
    try:
        pairs = tuple(sorted((k, v) for k, v in items))
    except (TypeError, ValueError):
        pairs = None
    if pairs is None or not all(isinstance(k, str) and isinstance(v, str) for k, v in pairs):
        raise ConfigurationError("env must be a dict of str -> str (environment variables for "
                                 f"the ranks); got {value!r}.")
    for k, v in pairs:
        why = ("is empty" if not k else "contains '='" if "=" in k else
               "contains a NUL byte" if "\0" in k else None)
        if why:
            raise ConfigurationError(f"env: the variable name {k!r} {why}, which no environment "
                                     "can hold; give names like MY_VAR (env={'MY_VAR': 'value'})")
        if "\0" in v:
            raise ConfigurationError(f"env: the value of {k} contains a NUL byte, which no "
                                     "environment can hold; remove it (or pass the data as an "
                                     "argument of the function)")
    return pairs


def max_arg_bytes(value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ConfigurationError(f"max_arg_bytes must be a positive int, got {value!r}.")
    return int(value)


def keep_alive(value) -> float | bool:   # False | True (the default idle limit) | idle s
    if value is None or value is False:
        return False
    if value is True:
        return constants.DEFAULT_KEEP_ALIVE_S
    if isinstance(value, numbers.Real) and math.isfinite(value) and value > 0:
        return float(value)
    raise ConfigurationError(f"keep_alive must be True, False or a positive number of idle "
                             f"seconds, got {value!r}.")


def plan(value):
    from .caller.fitcheck import validate
    return validate(value)


def flag(name: str, optional: bool = False):
    def check(value):
        if not isinstance(value, bool) and not (optional and value is None):
            raise ConfigurationError(f"{name}={value!r}: use True or False"
                                     + (" (None: automatic)" if optional else ""))
        return value
    return check


def tracking(value):
    from .tracking import settings
    cfg = settings.normalize(value)
    if cfg.enabled:
        settings.enabled(cfg)        # tracking=True without mlflow: say so now, not at launch
    return cfg


def cluster(value):
    if value is None:
        return None
    from .backends.ray.cluster import RayCluster
    return RayCluster.coerce(value)


def gpu_type(value):
    if value is None:
        return None
    from .hardware.catalog import AcceleratorType, GPUType
    if isinstance(value, (GPUType, AcceleratorType)):
        return value
    if isinstance(value, str) and value.strip().lower().startswith("gpu_"):
        return AcceleratorType.parse(value)
    return GPUType.parse(value)


# --------------------------------------------------------------------------- CLI parsers
def replicas(value):
    """None, an int, (min, max) or gpulaunch.ft.Replicas: checked without importing torchft."""
    if value is None:
        return None
    from .common.replica_spec import Replicas
    return Replicas.of(value)


def cli_seconds(text: str) -> float | None:
    return None if text.strip().lower() in ("none", "0", "inf", "") else float(text)


def cli_count(text: str) -> int | None:
    """``--gpus`` / ``--nproc-per-node``: a number, or torchrun's words: ``gpu`` (every GPU
    here), ``cpu`` (one rank per CPU core), ``auto`` (every GPU, else one rank per core)."""
    word = text.strip().lower()
    if word in ("all", "none"):
        return None
    if word in ("gpu", "cpu", "auto"):
        import os

        from .hardware import host
        gpus = len(host.detect().gpus) if word != "cpu" else 0
        if word == "gpu" and not gpus:
            raise ConfigurationError("--nproc-per-node gpu: this host has no GPU (give a number, "
                                     "or cpu for one rank per CPU core)")
        return None if gpus else os.cpu_count() or 1   # None: every GPU, resolved at launch
    if word == "xpu":
        raise ConfigurationError("--nproc-per-node xpu is not supported: gpulaunch runs on "
                                 "NVIDIA GPUs or CPU workers")
    try:
        return int(word)
    except ValueError:
        raise ConfigurationError(f"--nproc-per-node {text!r}: give a number, gpu, cpu or "
                                 "auto") from None


def cli_env(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigurationError(f"--env takes KEY=VALUE, got {item!r}")
        out[key] = value
    return out
