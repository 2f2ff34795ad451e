"""``LaunchOptions``: every launch setting, once. One frozen dataclass, one field per setting
with its documentation, default and check; everything else is derived from it:

* ``@distributed(...)`` / ``ray_launch(...)`` keyword arguments (``build``), and their
  ``__signature__``;
* ``DistributedFunction.with_overrides(...)`` (``dataclasses.replace``: any field can be set back
  to its default, ``None`` included);
* the ``gpulaunch run`` flags (``add_cli_arguments`` / ``from_cli``), with the same defaults;
* the variables a setting hands to every rank (field metadata ``rank_env``), applied by the one
  launch pipeline, so no entry point and no backend spells a setting out again.

Checks that need only the value run here, at decoration time; checks against the host (how
many GPUs, which type) run at launch (``caller.spec.resolve``), since ``CUDA_VISIBLE_DEVICES``
may change in between.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
from typing import Any, Callable

from .caller.fitcheck import parse_plan
from .common import constants
from .errors import ConfigurationError, GPUValidationError

LOG_MODES = ("all", "rank0", "none")
# The seed's positional order: distributed(num_accelerators, accelerator_type, remote, timeout).
POSITIONAL = ("gpus", "gpu_type", "remote", "timeout")
# The seed's newer spellings of two settings.
ALIASES = {"num_accelerators": "gpus", "accelerator_type": "gpu_type"}


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


def _seconds(name: str, allow_none: bool = True) -> Callable:
    def check(value):
        if value is None and allow_none:
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                or not math.isfinite(value) or value <= 0:
            raise ConfigurationError(f"{name} must be a positive number of seconds"
                                     f"{' or None' if allow_none else ''}, got {value!r}.")
        return float(value)
    return check


def _restarts(value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ConfigurationError(f"max_restarts must be an int >= 0, got {value!r}.")
    return int(value)


def _flag(name: str) -> Callable:
    def check(value):
        if not isinstance(value, bool):
            raise ConfigurationError(f"{name} must be True or False, got {value!r}.")
        return value
    return check


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


def _env(value) -> tuple[tuple[str, str], ...]:
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
    return pairs


def _max_arg_bytes(value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ConfigurationError(f"max_arg_bytes must be a positive int, got {value!r}.")
    return int(value)


def _keep_alive(value) -> float | bool:   # False | True (the default idle limit) | idle s
    if value is None or value is False:
        return False
    if value is True:
        return constants.DEFAULT_KEEP_ALIVE_S
    if isinstance(value, numbers.Real) and math.isfinite(value) and value > 0:
        return float(value)
    raise ConfigurationError(f"keep_alive must be True, False or a positive number of idle "
                             f"seconds, got {value!r}.")


def _plan(value):
    from .caller.fitcheck import validate
    return validate(value)


def _flag(name: str, optional: bool = False):
    def check(value):
        if not isinstance(value, bool) and not (optional and value is None):
            raise ConfigurationError(f"{name}={value!r}: use True or False"
                                     + (" (None: automatic)" if optional else ""))
        return value
    return check


def _tracking(value):
    from .tracking import settings
    cfg = settings.normalize(value)
    if cfg.enabled:
        settings.enabled(cfg)        # tracking=True without mlflow: say so now, not at launch
    return cfg


def _cluster(value):
    if value is None:
        return None
    from .backends.ray.cluster import RayCluster
    return RayCluster.coerce(value)


def _gpu_type(value):
    if value is None:
        return None
    from .hardware.catalog import AcceleratorType, GPUType
    if isinstance(value, (GPUType, AcceleratorType)):
        return value
    if isinstance(value, str) and value.strip().lower().startswith("gpu_"):
        return AcceleratorType.parse(value)
    return GPUType.parse(value)


# --------------------------------------------------------------------------- CLI parsers
def _cli_seconds(text: str) -> float | None:
    return None if text.strip().lower() in ("none", "0", "inf", "") else float(text)


def _cli_count(text: str) -> int | None:
    return None if text.strip().lower() in ("auto", "gpu", "all", "none") else int(text)


def _cli_env(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigurationError(f"--env takes KEY=VALUE, got {item!r}")
        out[key] = value
    return out


@dataclasses.dataclass(frozen=True)
class Cli:
    """How a setting appears on ``gpulaunch run``: flags, a parser from text, argparse extras."""

    flags: tuple[str, ...]
    parse: Callable[[Any], Any] | None = None
    kwargs: dict = dataclasses.field(default_factory=dict)


def setting(default=None, doc: str = "", *, check: Callable | None = None, cli: Cli | None = None,
            rank_env: str | None = None, factory: Callable | None = None):
    """A LaunchOptions field: default, documentation, value check, CLI flag, rank variable."""
    meta = {"doc": doc, "check": check, "cli": cli, "rank_env": rank_env}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


# --------------------------------------------------------------------------- the settings
@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """Every setting of a launch. Build with ``build(**kwargs)``; change with
    ``dataclasses.replace``. Each field's documentation is in its metadata (``describe()``)."""

    gpus: int | None = setting(
        None, "ranks on this host (None: every GPU here; 2 CPU workers on a host without GPUs); "
        "with remote=True, the total over the cluster's nodes. Alias: num_accelerators.",
        check=check_count,
        cli=Cli(("--gpus", "--nproc-per-node", "--nproc_per_node"), _cli_count,
                {"metavar": "N"}))
    gpu_type: Any = setting(
        None, "refuse to run unless the host has this GPU ('H100', 'h200', GPUType.A100, or "
        "'GPU_8xH100', which also sets the count). Alias: accelerator_type.",
        check=_gpu_type, cli=Cli(("--gpu-type",), str, {"metavar": "TYPE"}))
    remote: bool = setting(
        False, "run on a Ray cluster (gpulaunch[ray]) instead of this host; gpus= is then the "
        "total over the cluster (docs/multi-node.md).", check=_flag("remote"))
    cluster: Any = setting(
        None, "which Ray cluster: an address ('auto', 'head:6379', 'ray://...', 'local') or "
        "gpulaunch.RayCluster(...); implies remote=True. Default: $GPULAUNCH_RAY_ADDRESS, "
        "$RAY_ADDRESS, else 'auto'.", check=_cluster)
    timeout: float | None = setting(
        constants.DEFAULT_TIMEOUT_S, "seconds before every rank is stopped and RunTimeoutError "
        "raised (None: no limit).", check=_seconds("timeout"),
        cli=Cli(("--timeout",), _cli_seconds, {"metavar": "S"}))
    hang_timeout: float | None = setting(
        None, "seconds a rank may stay on the same line before the run is declared hung and "
        "every rank's stack reported (HangError). Off by default.",
        check=_seconds("hang_timeout"), rank_env="GPULAUNCH_HANG_TIMEOUT",
        cli=Cli(("--hang-timeout",), _cli_seconds, {"metavar": "S"}))
    max_restarts: int = setting(
        0, "restart the whole group this many times after a failure.", check=_restarts,
        cli=Cli(("--max-restarts", "--max_restarts"), int, {"metavar": "N"}))
    shutdown_grace: float = setting(
        constants.DEFAULT_SHUTDOWN_GRACE_S, "seconds between SIGTERM and SIGKILL when ranks are "
        "stopped.", check=_seconds("shutdown_grace", allow_none=False),
        cli=Cli(("--shutdown-grace",), float, {"metavar": "S"}))
    start_timeout: float = setting(
        constants.DEFAULT_START_TIMEOUT_S, "seconds the backend may take to start the ranks "
        "(node agents up, torch imported, placement on a Ray cluster) before the launch fails.",
        check=_seconds("start_timeout", allow_none=False),
        cli=Cli(("--start-timeout",), float, {"metavar": "S"}))
    node_lost_timeout: float = setting(
        constants.DEFAULT_NODE_LOST_TIMEOUT_S, "multi-node: seconds a node's agent may stay "
        "silent before the node is declared lost and the job stopped.",
        check=_seconds("node_lost_timeout", allow_none=False),
        cli=Cli(("--node-lost-timeout",), float, {"metavar": "S"}))
    stream_logs: Any = setting(
        "all", "which ranks' output the caller prints: 'all', 'rank0', 'none', or a list of "
        "ranks.", check=normalize_stream_logs,
        cli=Cli(("--logs",), str, {"metavar": "WHICH"}))
    env: tuple[tuple[str, str], ...] = setting(
        (), "extra environment variables for the ranks (a dict).", check=_env,
        cli=Cli(("--env",), _cli_env, {"action": "append", "metavar": "KEY=VALUE"}))
    max_arg_bytes: int = setting(
        constants.DEFAULT_MAX_ARG_BYTES, "largest pickled function or argument accepted "
        "(load larger data inside the function).", check=_max_arg_bytes)
    plan: dict | None = setting(
        None, "check GPU memory before launching: {'model': 'llama-3.1-8b', 'strategy': "
        "'fsdp', 'seq_len': 4096, ...} (any gpulaunch.planner.plan() argument); a strategy that "
        "would not fit is refused with what would (WontFitError); 'on_fail': 'warn' only warns.",
        check=_plan, cli=Cli(("--plan",), parse_plan, {"metavar": "KEY=VALUE,..."}))
    tracking: Any = setting(
        None, "the MLflow run of each call: None (on when mlflow is installed; "
        "GPULAUNCH_TRACKING=0 turns it off), False, True (required), an experiment name, or "
        "gpulaunch.tracking.Tracking(...).", check=_tracking)
    keep_alive: Any = setting(
        False, "keep the ranks (process group, CUDA context, NCCL, rt.state) alive after a call "
        "so that the next call with the same settings runs on them at once: True (closed after "
        "15 idle minutes), a number of idle seconds, or False. gpulaunch.shutdown() releases "
        "them (README: iterate fast in a notebook).", check=_keep_alive)

    panel: bool | None = setting(None, "the live run panel in Jupyter: None (on in a kernel "
        "with ipywidgets; GPULAUNCH_PANEL=0: off), True or False.", check=_flag("panel", True))
    debug: bool = setting(False, "on a rank's error, serve pdb there on loopback (`gpulaunch "
        "debug RUN --rank N` attaches).", check=_flag("debug"), rank_env="GPULAUNCH_DEBUG")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            check = f.metadata.get("check")
            if check is not None:
                object.__setattr__(self, f.name, check(getattr(self, f.name)))
        if self.cluster is not None and not self.remote:
            object.__setattr__(self, "remote", True)

    # the seed product's newer spellings
    num_accelerators = property(lambda self: self.gpus)
    accelerator_type = property(lambda self: self.gpu_type)

    def rank_env(self) -> dict[str, str]:
        """The variables this launch's settings hand to every rank (``rank_env`` metadata)."""
        out = {}
        for f in dataclasses.fields(self):
            name = f.metadata.get("rank_env")
            value = getattr(self, f.name)
            if name and value is not None and value is not False:
                out[name] = str(value)
        return out

    def replace(self, **changes) -> "LaunchOptions":
        """A copy with some settings changed (aliases accepted; None is a value too)."""
        return dataclasses.replace(self, **_canonical(_without_unset_aliases(changes)))


def field_names() -> set[str]:
    return {f.name for f in dataclasses.fields(LaunchOptions)}


def _canonical(kwargs: dict) -> dict:
    """Map the seed's aliases to field names; refuse unknown names and double spellings."""
    names = field_names()
    unknown = sorted(k for k in kwargs if ALIASES.get(k, k) not in names)
    if unknown:
        raise ConfigurationError(f"unknown settings {unknown}; known: "
                                 f"{sorted(names | set(ALIASES))}.")
    out: dict = {}
    for key, value in kwargs.items():
        field = ALIASES.get(key, key)
        if field in out:
            alias = next(a for a, f in ALIASES.items() if f == field)
            raise ConfigurationError(f"Pass either {field}= or {alias}=, not both.")
        out[field] = value
    return out


def build(*args, **kwargs) -> LaunchOptions:
    """``LaunchOptions`` from what a user wrote: the seed's positional order
    (num_accelerators, accelerator_type, remote, timeout), field names and aliases."""
    if len(args) > len(POSITIONAL):
        raise ConfigurationError(f"at most {len(POSITIONAL)} positional settings "
                                 f"({', '.join(POSITIONAL)}); pass the rest by name.")
    # The count and type positionally as None mean "not given" (their default anyway), so
    # that distributed(None, gpus=2) works as in the seed; remote and timeout are values.
    given = {name: value for name, value in zip(POSITIONAL, args)
             if value is not None or name in ("remote", "timeout")}
    positional = set(given)
    for key, value in _without_unset_aliases(kwargs).items():
        if ALIASES.get(key, key) in positional:
            raise ConfigurationError(f"{ALIASES.get(key, key)} was given twice (positionally "
                                     f"and as {key}=).")
        given[key] = value
    return LaunchOptions(**_canonical(given))


def _without_unset_aliases(kwargs: dict) -> dict:
    """``num_accelerators=None`` / ``accelerator_type=None`` are the seed's "not given" (its
    signatures default them to None); the field names themselves take None as a value."""
    return {k: v for k, v in kwargs.items() if not (k in ALIASES and v is None)}


def describe() -> list[tuple[str, Any, str]]:
    """(name, default, documentation) of every setting, for docs and help()."""
    out = []
    for f in dataclasses.fields(LaunchOptions):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out.append((f.name, default, f.metadata.get("doc", "")))
    return out


def signature(leading: tuple[str, ...] = ("num_accelerators", "accelerator_type", "remote",
                                          "timeout")) -> inspect.Signature:
    """The decorators' signature, derived from the fields (for help() and IDEs)."""
    fields = {f.name: f for f in dataclasses.fields(LaunchOptions)}
    params, seen = [], set()
    for name in leading:
        target = ALIASES.get(name, name)
        seen.add(name)
        params.append(inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                        default=fields[target].default))
    for name, f in fields.items():
        if name in seen:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default))
    return inspect.Signature(params)


# --------------------------------------------------------------------------- the CLI
def add_cli_arguments(parser) -> None:
    """Add a flag for every setting that has one. A flag not given is left out of the parsed
    namespace (argparse.SUPPRESS), so ``from_cli`` tells "not given" (the dataclass default,
    the same as the decorator's) from a value, ``--timeout none`` included."""
    import argparse
    for f in dataclasses.fields(LaunchOptions):
        cli: Cli | None = f.metadata.get("cli")
        if cli is None:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kwargs = dict(cli.kwargs)
        if kwargs.get("action") != "append":
            kwargs.setdefault("type", cli.parse or str)
        parser.add_argument(*cli.flags, dest=f"opt_{f.name}", default=argparse.SUPPRESS,
                            help=f"{f.metadata.get('doc', '')} (default: {default!r})", **kwargs)


def from_cli(args, **extra) -> LaunchOptions:
    """``LaunchOptions`` from parsed ``gpulaunch run`` flags (plus settings the CLI decides)."""
    given = {}
    for f in dataclasses.fields(LaunchOptions):
        cli: Cli | None = f.metadata.get("cli")
        if cli is None or not hasattr(args, f"opt_{f.name}"):
            continue
        raw = getattr(args, f"opt_{f.name}")
        if cli.kwargs.get("action") == "append" and cli.parse is not None:
            raw = cli.parse(raw)
        given[f.name] = raw
    given.update(extra)
    return LaunchOptions(**given)
