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
from typing import Any, Callable

from . import option_checks as checks
from .caller.fitcheck import parse_plan
from .common import constants
from .errors import ConfigurationError

# The seed's positional order: distributed(num_accelerators, accelerator_type, remote, timeout).
POSITIONAL = ("gpus", "gpu_type", "remote", "timeout")
# The seed's newer spellings of two settings.
ALIASES = {"num_accelerators": "gpus", "accelerator_type": "gpu_type"}


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
        check=checks.check_count,
        cli=Cli(("--gpus", "--nproc-per-node", "--nproc_per_node"), checks.cli_count,
                {"metavar": "N"}))
    gpu_type: Any = setting(
        None, "refuse to run unless the host has this GPU ('H100', 'h200', GPUType.A100, or "
        "'GPU_8xH100', which also sets the count). Alias: accelerator_type.",
        check=checks.gpu_type, cli=Cli(("--gpu-type",), str, {"metavar": "TYPE"}))
    remote: bool = setting(
        False, "run on a Ray cluster (gpulaunch[ray]) instead of this host; gpus= is then the "
        "total over the cluster (docs/multi-node.md).", check=checks.flag("remote"))
    cluster: Any = setting(
        None, "which Ray cluster: an address ('auto', 'head:6379', 'ray://...', 'local') or "
        "gpulaunch.RayCluster(...); implies remote=True. Default: $GPULAUNCH_RAY_ADDRESS, "
        "$RAY_ADDRESS, else 'auto'.", check=checks.cluster,
        cli=Cli(("--cluster",), str, {"metavar": "ADDRESS"}))
    timeout: float | None = setting(
        constants.DEFAULT_TIMEOUT_S, "seconds before every rank is stopped and RunTimeoutError "
        "raised (None: no limit).", check=checks.seconds("timeout"),
        cli=Cli(("--timeout",), checks.cli_seconds, {"metavar": "S"}))
    hang_timeout: float | None = setting(
        None, "seconds a rank may stay on the same line before the run is declared hung and "
        "every rank's stack reported (HangError). Off by default.",
        check=checks.seconds("hang_timeout"),
        cli=Cli(("--hang-timeout",), checks.cli_seconds, {"metavar": "S"}))
    max_restarts: int = setting(
        0, "restart the whole group this many times after a failure.", check=checks.restarts,
        cli=Cli(("--max-restarts", "--max_restarts"), int, {"metavar": "N"}))
    max_preemptions: int | None = setting(
        None, "restart the group here this many times after a preemption notice it saved a "
        "checkpoint for (parallel.save_on_preemption; None: 0, the run stops with "
        "PreemptedError and the next start resumes); counted apart from max_restarts "
        "(docs/fault-tolerance.md, Preemption).", check=checks.preemptions,
        rank_env="GPULAUNCH_MAX_PREEMPTIONS",
        cli=Cli(("--max-preemptions",), int, {"metavar": "N"}))
    preempt_grace: float | None = setting(
        None, "seconds a preemption notice leaves for the checkpoint: with it set, SIGTERM or "
        "SIGUSR1 to the caller during a call is a notice (the ranks save, then the call raises "
        "PreemptedError) instead of an end. Default: $GPULAUNCH_PREEMPT_GRACE_S, else off.",
        check=checks.seconds("preempt_grace"), rank_env="GPULAUNCH_PREEMPT_GRACE_S",
        cli=Cli(("--preempt-grace",), checks.cli_seconds, {"metavar": "S"}))
    preempt_watch: str | None = setting(
        None, "watch this cloud's instance metadata service for a preemption notice ('aws': "
        "spot instance-action, 'gcp': instance/preempted, 'azure': a Preempt scheduled event): "
        "the caller polls it every second or so during a call and turns a notice into the same "
        "checkpoint-then-stop as SIGTERM. This host only (not with remote=). Default: "
        "$GPULAUNCH_PREEMPT_WATCH, else off.", check=checks.preempt_watch,
        cli=Cli(("--preempt-watch",), str, {"metavar": "CLOUD"}))
    shutdown_grace: float = setting(
        constants.DEFAULT_SHUTDOWN_GRACE_S, "seconds between SIGTERM and SIGKILL when ranks are "
        "stopped.", check=checks.seconds("shutdown_grace", allow_none=False),
        cli=Cli(("--shutdown-grace",), float, {"metavar": "S"}))
    start_timeout: float = setting(
        constants.DEFAULT_START_TIMEOUT_S, "seconds the backend may take to start the ranks "
        "(node agents up, torch imported, placement on a Ray cluster) before the launch fails.",
        check=checks.seconds("start_timeout", allow_none=False),
        cli=Cli(("--start-timeout",), float, {"metavar": "S"}))
    node_lost_timeout: float = setting(
        constants.DEFAULT_NODE_LOST_TIMEOUT_S, "multi-node: seconds a node's agent may stay "
        "silent before the node is declared lost and the job stopped.",
        check=checks.seconds("node_lost_timeout", allow_none=False),
        cli=Cli(("--node-lost-timeout",), float, {"metavar": "S"}))
    stream_logs: Any = setting(
        "all", "which ranks' output the caller prints: 'all', 'rank0', 'none', or a list of "
        "ranks.", check=checks.normalize_stream_logs,
        cli=Cli(("--logs",), str, {"metavar": "WHICH"}))
    env: tuple[tuple[str, str], ...] = setting(
        (), "extra environment variables for the ranks (a dict).", check=checks.env,
        cli=Cli(("--env",), checks.cli_env, {"action": "append", "metavar": "KEY=VALUE"}))
    max_arg_bytes: int = setting(
        constants.DEFAULT_MAX_ARG_BYTES, "largest pickled function or argument accepted "
        "(load larger data inside the function).", check=checks.max_arg_bytes)
    plan: dict | None = setting(
        None, "check GPU memory before launching: {'model': 'llama-3.1-8b', 'strategy': "
        "'fsdp', 'seq_len': 4096, ...} (any gpulaunch.planner.plan() argument); a strategy that "
        "would not fit is refused with what would (WontFitError); 'on_fail': 'warn' only warns.",
        check=checks.plan, cli=Cli(("--plan",), parse_plan, {"metavar": "KEY=VALUE,..."}))
    tracking: Any = setting(
        None, "the MLflow run of each call: None (on when mlflow is installed; "
        "GPULAUNCH_TRACKING=0 turns it off), False, True (required), an experiment name, or "
        "gpulaunch.tracking.Tracking(...).", check=checks.tracking)
    keep_alive: Any = setting(
        False, "keep the ranks (process group, CUDA context, NCCL, rt.state) alive after a call "
        "so that the next call with the same settings runs on them at once: True (closed after "
        "15 idle minutes), a number of idle seconds, or False. gpulaunch.shutdown() releases "
        "them (README: iterate fast in a notebook).", check=checks.keep_alive)

    replicas: Any = setting(
        None, "fault-tolerant replica groups (gpulaunch[ft], on torchft): N groups, (min, max) "
        "for an elastic size, or gpulaunch.ft.Replicas(...); gpus= is then the ranks of each "
        "group (default 1; more: FSDP2 inside each group, HSDP). A failed group is replaced alone "
        "while the others keep stepping, and heals from a live peer; .distributed() then "
        "returns a gpulaunch.ft.ReplicasResult (docs/fault-tolerance.md).",
        check=checks.replicas)
    panel: bool | None = setting(None, "the live run panel in Jupyter: None (on in a kernel "
        "with ipywidgets; GPULAUNCH_PANEL=0: off), True or False.", check=checks.flag("panel", True))
    debug: bool = setting(False, "on a rank's error, serve pdb there on loopback (`gpulaunch "
        "debug RUN --rank N` attaches).", check=checks.flag("debug"))

    def __post_init__(self):
        for f in dataclasses.fields(self):
            check = f.metadata.get("check")
            if check is not None:
                object.__setattr__(self, f.name, check(getattr(self, f.name)))
        if self.cluster is not None and not self.remote:
            object.__setattr__(self, "remote", True)
        if self.preempt_watch is not None and self.remote:
            raise ConfigurationError(
                f"preempt_watch={self.preempt_watch!r} with a Ray run: preemption notices reach "
                "the ranks of runs on this host only (each Ray node has its own). Checkpoint "
                "periodically (save_checkpoint) instead, or launch on this host.")
        if self.replicas is not None:
            from .common.replica_spec import conflicts
            conflicts(self)

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
